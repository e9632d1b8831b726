"""The local Slurm cluster (slurm/local_cluster.sh) for tests: the fixture body, job submission, waiting, and the
check that a job left no process behind. Shared by every module of the SLURM tier so each adds only its own jobs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers.procs import live_processes_with_env
from helpers.tiers import tier_unavailable

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "slurm" / "local_cluster.sh"
STATE_DIR = os.environ.get("MPO_SLURM_DIR", "/tmp/mpo-slurm")
JOB_LIMIT_S = 240  # wall-clock bound per job (the demo takes ~45 s here)


def cluster_fixture(request: pytest.FixtureRequest):
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


def job_processes(job_id: str) -> dict[int, str]:
    """Live (non-zombie) processes of a Slurm job, found by SLURM_JOB_ID in their environment: pid -> cmdline."""
    return live_processes_with_env("SLURM_JOB_ID", job_id)


def env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def submit(cluster_env: dict, out_file: Path, overrides: str,
           config: str = "mpo/recipes/demo_cpu.yaml") -> tuple[subprocess.Popen, str, str]:
    name = f"mpo-test-{uuid.uuid4().hex[:8]}"
    # two nodes, a trainer rank on each: the config at a two-rank layout (EP2; `mpo demo` itself runs one rank)
    env = {**cluster_env, "MPO_CONFIG": config,
           "MPO_OVERRIDES": f"world_size=2 parallel.expert_parallel=2 {overrides}",
           "MPO_PYTHON": sys.executable, "MPO_REPO": str(REPO)}
    proc = subprocess.Popen(["sbatch", "--wait", "--parsable", f"--job-name={name}", "--nodes=2",
                             "--gpus-per-node=0", "--time=4", "-o", str(out_file), "slurm/train.sbatch"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = proc.stdout.readline().strip().split(";")[0]
    assert job_id.isdigit(), proc.stderr.read()
    return proc, job_id, name


def wait(proc: subprocess.Popen, name: str, env: dict, limit_s: float = JOB_LIMIT_S) -> int:
    """The job's exit code; past `limit_s` (queueing included: the cluster is shared) it is cancelled and fails."""
    try:
        return proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], env=env)
        proc.kill()
        pytest.fail(f"job {name} did not finish in {limit_s:.0f} s (cancelled)")


def assert_nothing_left(job_id: str, reported_pids: list[int]) -> None:
    deadline = time.monotonic() + 20  # slurmstepd may need KillWait to finish its own exit
    while time.monotonic() < deadline:
        left = job_processes(job_id)
        alive = [p for p in reported_pids if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        if not left and not alive:
            return
        time.sleep(0.5)
    pytest.fail(f"processes of job {job_id} still running: {left} {alive}")
