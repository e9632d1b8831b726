import functools
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
# (`tests/run.sh` runs 2 workers) a module's tests stay on one worker with its module-scoped fixtures, and the modules
# that name one of these helpers run one after another on one worker.
SHARED_RESOURCE_HELPERS = ("cluster_fixture", "serve_module", "start_sglang_server")
SHARED_RESOURCE_GROUP = "slurm-and-sglang"


@functools.cache  # one read per module file, not one per test
def _shares_a_resource(module: Path) -> bool:
    try:
        text = module.read_text(errors="replace")
    except OSError:
        return False
    return any(name in text for name in SHARED_RESOURCE_HELPERS)


def work_unit(nodeid: str, root: Path) -> str:
    """The unit of work a test belongs to under xdist: its module file, or SHARED_RESOURCE_GROUP."""
    module = nodeid.split("::", 1)[0]
    return SHARED_RESOURCE_GROUP if _shares_a_resource(root / module) else module


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist installed, one process runs everything
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with work_unit as the scope (its `--dist loadgroup` marks are not used: with pytest
    9.2, xdist 3.8 writes the group into an attribute the test id no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        _split_scope = staticmethod(functools.partial(work_unit, root=Path(config.rootpath)))

    return ModuleScheduling(config, log)



class _WorkLedger:
    """A plugin on the controller (or the one process): seconds per work unit and per worker, summed from the test
    reports (set-up, call and tear-down) and printed at the end, so a run past the 30-minute budget says which unit
    and which worker carried it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.units: dict[str, float] = {}
        self.unit_worker: dict[str, str] = {}
        self.workers: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        node = getattr(report, "node", None)  # xdist's WorkerController on the controller; absent in one process
        worker = node.gateway.id if node is not None else "main"
        unit = work_unit(report.nodeid, self.root)
        self.units[unit] = self.units.get(unit, 0.0) + report.duration
        self.unit_worker[unit] = worker
        self.workers[worker] = self.workers.get(worker, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.workers:
            return
        busiest = sorted(self.units.items(), key=lambda item: -item[1])[:8]
        terminalreporter.write_line(
            "seconds per worker: " + ", ".join(f"{w} {s:.0f}" for w, s in sorted(self.workers.items())))
        terminalreporter.write_line(
            "largest work units: " + ", ".join(f"{u} {s:.0f} ({self.unit_worker[u]})" for u, s in busiest))


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # xdist's workers report to the controller, which sums
        config.pluginmanager.register(_WorkLedger(Path(config.rootpath)), "mpo-work-ledger")
