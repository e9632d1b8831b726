"""mpo.lean_imports: megatron-core's start-up import of wandb is declined, every other importer still gets wandb.

Fresh interpreters (the finder is process state): one imports mpo then megatron.core and reports what megatron's
timers hold and whether wandb got loaded; then it imports wandb itself, as mpo's metrics log does.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import mpo
import megatron.core.timers as timers
import megatron.core
found = {"loaded_by_megatron": "wandb" in sys.modules, "timers_wandb": repr(timers.wandb)}
import wandb
found["later_import"] = wandb.__name__
from mpo.trainer.metrics_log import MetricsLog  # mpo's own wandb path imports it lazily, from mpo's modules
print(json.dumps(found))
"""


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb is not installed (tests/requirements-ci.txt installs it): nothing to decline")
def test_megatron_does_not_load_wandb_and_mpo_still_can():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={"TORCHDYNAMO_DISABLE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"loaded_by_megatron": False, "timers_wandb": "None", "later_import": "wandb"}


def test_without_the_finder_megatron_loads_wandb():
    """Without mpo's finder megatron would have loaded wandb: the probe above can fail (checked by removing it)."""
    out = subprocess.run([sys.executable, "-c", "import sys, mpo, mpo.lean_imports as li\n"
                          "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, li._Decline)]\n"
                          "import megatron.core.timers as t\nprint(t.wandb is not None, 'wandb' in sys.modules)"],
                         capture_output=True, text=True, timeout=300, env={"TORCHDYNAMO_DISABLE": "1",
                                                                          "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    expected = importlib.util.find_spec("wandb") is not None
    assert out.stdout.split() == [str(expected), str(expected)]
