"""The project's own sbatch script on a real local Slurm cluster (slurm/local_cluster.sh: munged, slurmctld, and two
slurmd emulating nodes n1 and n2 on this machine).

Real: munge, slurmctld, slurmd, sbatch/srun, one `python -m launch` agent per node, torchrun with a 2-node static
rendezvous, gloo, mpo's engine and trainer. Emulated: the two "nodes" are one machine (Slurm's MULTIPLE_SLURMD), so
node names resolve to 127.0.0.1; the failure test kills a trainer rank with SIGKILL from outside, the way the
kernel's OOM killer would.

Needs root and Debian's Slurm packages (local_cluster.sh installs them); without them the whole module skips with
"SLURM TIER SKIPPED: <why>" in the summary, except in CI (CI=true) where it fails (helpers/tiers.py); MPO_SKIP_SLURM=1
skips it only outside CI.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from helpers.slurm_cluster import assert_nothing_left, cluster_fixture, env_of, job_processes, submit, wait


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest):
    yield from cluster_fixture(request)


def test_sbatch_runs_cpu_demo_on_two_nodes(cluster, tmp_path):
    out_dir, out_file = tmp_path / "run", tmp_path / "job.out"
    t0 = time.monotonic()
    proc, job_id, name = submit(cluster, out_file, f"schedule.steps=3 schedule.sft_steps=2 logging.out_dir={out_dir} "
                                                    "logging.progress=false logging.tensorboard=false")
    code = wait(proc, name, cluster)
    output = out_file.read_text() if out_file.exists() else ""
    print(f"\n[slurm] 2-node demo job {job_id}: exit {code} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    assert code == 0, output
    import json

    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "node 0 (n1): trainer finished (exit 0)" in output
    assert "node 1 (n2): run finished; engines stopped" in output
    # Trainer ranks ran on both nodes: one torchrun per node, 1 rank each, rank 0 on n1.
    run_dir = out_dir / "launch" / f"{job_id}.0"
    assert (run_dir / "node0-n1" / "trainer.log").exists() and (run_dir / "node1-n2" / "trainer.log").exists()
    assert (run_dir / "node1-n2" / "engine0.log").exists()
    assert_nothing_left(job_id, [int(p) for p in re.findall(r"\(pid (\d+)\)", output)])


def test_failed_rank_on_node2_fails_job_and_stops_everything(cluster, tmp_path):
    out_dir, out_file = tmp_path / "run", tmp_path / "job.out"
    proc, job_id, name = submit(cluster, out_file, f"schedule.steps=50 logging.out_dir={out_dir} "
                                                    "logging.progress=false")
    # Find the trainer rank (a torchrun worker: LOCAL_RANK set) on node n2, and kill it like the OOM killer would.
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        for pid, cmd in job_processes(job_id).items():
            if "mpo.trainer" in cmd and "torch.distributed.run" not in cmd:
                try:
                    env = env_of(pid)
                except OSError:
                    continue
                if env.get("SLURMD_NODENAME") == "n2" and "LOCAL_RANK" in env:
                    victim = pid
        time.sleep(0.1)
    assert victim is not None, "never saw the trainer rank on n2"
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    code = wait(proc, name, cluster)
    output = out_file.read_text()
    print(f"\n[slurm] failure job {job_id}: exit {code}, {time.monotonic() - t_kill:.1f} s after the kill\n{output}",
          file=sys.stderr)
    assert code != 0, output
    failed = re.search(r"node 1 \(n2\): FAILED: trainer exited with code \d+; log: (\S+)", output)
    assert failed, output
    assert Path(failed.group(1)).exists() and "SIGKILL" in Path(failed.group(1)).read_text()
    assert_nothing_left(job_id, [int(p) for p in re.findall(r"\(pid (\d+)\)", output)] + [victim])
