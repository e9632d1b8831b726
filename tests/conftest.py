import os
import sys
from pathlib import Path

import pytest

# Tests import helpers as `tests.helpers...`-free top-level modules; spawned ranks inherit this sys.path.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# As mpo's ranks and engines do (mpo.parallel.device): without a GPU, torch.compile off in the test process and every
# worker it spawns, so each import of megatron-core skips building inductor wrappers the CPU path never calls.
from mpo.parallel.device import skip_torch_compile_without_gpu  # noqa: E402

skip_torch_compile_without_gpu()

# Test modules that share one machine-wide resource: the local SLURM cluster (one set of daemons; a module stops it when
# it started it) or real SGLang servers (~1 core each while they start, and a rehearsal runs two). Under xdist
# (`tests/run.sh` runs 2 workers) these modules run one after another on one worker; every other module is a group
# of its own, so a module's tests and its module-scoped fixtures stay on one worker (pytest-xdist `--dist loadgroup`).
SHARED_RESOURCE_HELPERS = ("cluster_fixture", "serve_module", "start_sglang_server")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    shared: dict[str, bool] = {}  # module file -> whether it names one of SHARED_RESOURCE_HELPERS (also in a function)
    for item in items:
        path = str(item.path)
        if path not in shared:
            text = item.path.read_text(errors="replace")
            shared[path] = any(name in text for name in SHARED_RESOURCE_HELPERS)
        item.add_marker(pytest.mark.xdist_group("slurm-and-sglang" if shared[path] else item.path.stem))
