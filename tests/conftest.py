import os
import sys
from pathlib import Path

# Tests import helpers as `tests.helpers...`-free top-level modules; spawned ranks inherit this sys.path.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# As mpo's ranks and engines do (mpo.parallel.device): without a GPU, torch.compile off in the test process and every
# worker it spawns, so each import of megatron-core skips building inductor wrappers the CPU path never calls.
from mpo.parallel.device import skip_torch_compile_without_gpu  # noqa: E402

skip_torch_compile_without_gpu()
