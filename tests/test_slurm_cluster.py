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
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers.procs import live_processes_with_env
from helpers.tiers import tier_unavailable

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "slurm" / "local_cluster.sh"
STATE_DIR = os.environ.get("MPO_SLURM_DIR", "/tmp/mpo-slurm")
JOB_LIMIT_S = 240  # wall-clock bound per job (the demo takes ~45 s here)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest):
    """Starts the local cluster (idempotent); stops it afterwards only if this fixture started it."""
    if os.environ.get("MPO_SKIP_SLURM") == "1":
        tier_unavailable("SLURM", "MPO_SKIP_SLURM=1 (a way to skip the tier outside CI; CI=true runs it)", request)
    env = {**os.environ, "MPO_SLURM_DIR": STATE_DIR, "SLURM_CONF": f"{STATE_DIR}/slurm.conf"}
    was_up = subprocess.run(["bash", str(CLUSTER), "status"], env=env, capture_output=True).returncode == 0
    t0 = time.monotonic()
    try:
        start = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        tier_unavailable("SLURM", "slurm/local_cluster.sh start took over 300 s", request)
    if start.returncode != 0:
        last = (start.stderr.strip().splitlines() or ["(no output)"])[-1]
        tier_unavailable("SLURM", f"slurm/local_cluster.sh start failed (exit {start.returncode}): {last}", request)
    print(f"\n[slurm] cluster up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    yield env
    if not was_up:
        subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, timeout=120)


def _job_processes(job_id: str) -> dict[int, str]:
    """Live (non-zombie) processes of a Slurm job, found by SLURM_JOB_ID in their environment: pid -> cmdline."""
    return live_processes_with_env("SLURM_JOB_ID", job_id)


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _submit(cluster_env: dict, out_file: Path, overrides: str) -> tuple[subprocess.Popen, str, str]:
    name = f"mpo-test-{uuid.uuid4().hex[:8]}"
    # two nodes, a trainer rank on each: the demo at its two-rank layout (EP2; `mpo demo` itself runs one rank)
    env = {**cluster_env, "MPO_CONFIG": "mpo/recipes/demo_cpu.yaml",
           "MPO_OVERRIDES": f"world_size=2 parallel.expert_parallel=2 {overrides}",
           "MPO_PYTHON": sys.executable, "MPO_REPO": str(REPO)}
    proc = subprocess.Popen(["sbatch", "--wait", "--parsable", f"--job-name={name}", "--nodes=2",
                             "--gpus-per-node=0", "--time=4", "-o", str(out_file), "slurm/train.sbatch"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = proc.stdout.readline().strip().split(";")[0]
    assert job_id.isdigit(), proc.stderr.read()
    return proc, job_id, name


def _wait(proc: subprocess.Popen, name: str, env: dict) -> int:
    try:
        return proc.wait(JOB_LIMIT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], env=env)
        proc.kill()
        pytest.fail(f"job {name} did not finish in {JOB_LIMIT_S} s (cancelled)")


def _assert_nothing_left(job_id: str, reported_pids: list[int]) -> None:
    deadline = time.monotonic() + 20  # slurmstepd may need KillWait to finish its own exit
    while time.monotonic() < deadline:
        left = _job_processes(job_id)
        alive = [p for p in reported_pids if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        if not left and not alive:
            return
        time.sleep(0.5)
    pytest.fail(f"processes of job {job_id} still running: {left} {alive}")


def test_sbatch_runs_cpu_demo_on_two_nodes(cluster, tmp_path):
    out_dir, out_file = tmp_path / "run", tmp_path / "job.out"
    t0 = time.monotonic()
    proc, job_id, name = _submit(cluster, out_file, f"schedule.steps=3 schedule.sft_steps=2 logging.out_dir={out_dir} "
                                                    "logging.progress=false logging.tensorboard=false")
    code = _wait(proc, name, cluster)
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
    _assert_nothing_left(job_id, [int(p) for p in re.findall(r"\(pid (\d+)\)", output)])


def test_failed_rank_on_node2_fails_job_and_stops_everything(cluster, tmp_path):
    out_dir, out_file = tmp_path / "run", tmp_path / "job.out"
    proc, job_id, name = _submit(cluster, out_file, f"schedule.steps=50 logging.out_dir={out_dir} "
                                                    "logging.progress=false")
    # Find the trainer rank (a torchrun worker: LOCAL_RANK set) on node n2, and kill it like the OOM killer would.
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        for pid, cmd in _job_processes(job_id).items():
            if "mpo.trainer" in cmd and "torch.distributed.run" not in cmd:
                try:
                    env = _env_of(pid)
                except OSError:
                    continue
                if env.get("SLURMD_NODENAME") == "n2" and "LOCAL_RANK" in env:
                    victim = pid
        time.sleep(0.1)
    assert victim is not None, "never saw the trainer rank on n2"
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    code = _wait(proc, name, cluster)
    output = out_file.read_text()
    print(f"\n[slurm] failure job {job_id}: exit {code}, {time.monotonic() - t_kill:.1f} s after the kill\n{output}",
          file=sys.stderr)
    assert code != 0, output
    failed = re.search(r"node 1 \(n2\): FAILED: trainer exited with code \d+; log: (\S+)", output)
    assert failed, output
    assert Path(failed.group(1)).exists() and "SIGKILL" in Path(failed.group(1)).read_text()
    _assert_nothing_left(job_id, [int(p) for p in re.findall(r"\(pid (\d+)\)", output)] + [victim])
