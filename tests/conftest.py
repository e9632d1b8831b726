import os
import sys
from pathlib import Path

# Tests import helpers as `tests.helpers...`-free top-level modules; spawned ranks inherit this sys.path.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
