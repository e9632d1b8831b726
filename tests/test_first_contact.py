"""First contact at target scale (issue #45, items 2, 3, 4 and 6): waits sized to the work, a probe that cannot kill a
healthy bf16 run, layouts no transport can sync refused up front, and SGLang request fields and timeouts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GSPO = "mpo/recipes/qwen3_30b_a3b_gspo.yaml"


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)


# -- item 4: colocated layouts across nodes ----------------------------------------------------------------------

COLOCATED_TWO_NODES = ["rollout.colocate=true", "schedule.mode=sync", "sync.transport=tensor"]  # world_size 16


@pytest.mark.parametrize("argv", [
    ("-m", "mpo.cli", "check-config", "--config", GSPO, *COLOCATED_TWO_NODES),
    ("-m", "mpo.cli", "plan", "--config", GSPO, *COLOCATED_TWO_NODES),
    ("-m", "launch", "--config", GSPO, "--hosts", "g1,g2", "--gpus-per-node", "8", "--dry-run",
     *COLOCATED_TWO_NODES),
], ids=["check-config", "plan", "launch-dry-run"])
def test_first_contact_colocated_multi_node_layout_is_refused_in_one_line(argv):
    """Qwen3-30B-A3B's 16 trainer ranks on two 8-GPU nodes with SGLang colocated: 'tensor' reaches only the engines
    on rank 0's node; the run must not start (it used to fail after full start-up)."""
    out = _cli(*argv)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "rollout.colocate=true with the trainer on 2 nodes" in lines[0], out.stderr


def test_first_contact_launch_refuses_engines_placed_on_trainer_gpus_of_two_nodes():
    """No node left for rollout (2 nodes, 16 ranks): the launcher colocates the engines on the trainer's nodes even
    with rollout.colocate=false; every transport misses some engine or shares a GPU in NCCL."""
    from launch.plan import Allocation, LaunchOptions, PlanError, make_plan
    from mpo.config import load_config

    for transport, message in (("tensor", "on 2 nodes"), ("cuda_ipc", "on 2 nodes"),
                               ("distributed", "NCCL cannot hold one device twice")):
        overrides = [f"sync.transport={transport}", "rollout.num_engines=2", "rollout.tensor_parallel=4"]
        config = load_config(str(REPO / GSPO), overrides)
        with pytest.raises(PlanError, match=message):
            make_plan(config, Allocation(hosts=("g1", "g2"), gpus_per_node=8, job_id="1"),
                      LaunchOptions(config_path=str(REPO / GSPO), overrides=tuple(overrides)))
