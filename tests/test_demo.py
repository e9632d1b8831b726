"""`mpo demo`, the README's main job, as a user runs it (real processes: torchrun, 2 gloo ranks, an engine server):
reward rises with RL, and a run killed after a checkpoint resumes to exactly the metrics of an uninterrupted run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Wall-clock measurements differ between runs by nature; everything else must be identical after a resume.
TIMING_KEYS = ("rollout_time_s", "rollout_tokens_per_s", "train_time_s", "train_tokens_per_s", "sync_time_s",
               "sync_bytes_per_s")


def _demo_command(out: Path, steps: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "mpo.cli", "demo", "--steps", str(steps), "--out", str(out),
            "logging.progress=false", *overrides]


def _run(command: list[str], log: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    with log.open("w") as f:
        return subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_demo_reward_rises(tmp_path):
    out = tmp_path / "demo"
    result = _run(_demo_command(out, 40), tmp_path / "demo.log")
    log = (tmp_path / "demo.log").read_text()
    assert result.returncode == 0, log[-3000:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(40))
    before = sum(r["reward_mean"] for r in rows[:5]) / 5
    after = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert after > before + 0.03, f"reward did not rise: first 5 steps {before:.3f}, last 5 {after:.3f}"
    assert "before RL" in log and (out / "demo.png").stat().st_size > 1000
    assert all(r["train_rollout_logprob_absdiff"] < 1e-5 for r in rows if "train_rollout_logprob_absdiff" in r)


def test_ppo_with_a_critic_raises_the_reward(tmp_path):
    """PPO on the demo task: GAE advantages from the megatron critic (mpo/recipes/demo_cpu_ppo.yaml's algorithm);
    the critic is scored and trained every step, and the policy's reward rises over a short run."""
    out = tmp_path / "ppo"
    overrides = ("algorithm.loss=grpo", "algorithm.advantage=gae", "algorithm.advantage_args={lam: 0.95}",
                 "algorithm.critic_lr=0.002", "algorithm.filter_zero_variance=false", "logging.tensorboard=false")
    result = _run(_demo_command(out, 24, *overrides), tmp_path / "ppo.log")
    assert result.returncode == 0, (tmp_path / "ppo.log").read_text()[-3000:]
    rows = _metrics(out)
    before = sum(r["reward_mean"] for r in rows[:5]) / 5
    after = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert after > before + 0.03, f"reward did not rise: first 5 steps {before:.3f}, last 5 {after:.3f}"
    assert all(math.isfinite(r["critic/value_loss"]) and r["critic/grad_norm"] > 0 for r in rows)


PPO = ("algorithm.loss=grpo", "algorithm.advantage=gae", "algorithm.filter_zero_variance=false")


@pytest.mark.parametrize("algorithm", [(), PPO], ids=["gspo", "ppo-critic"])
def test_killed_run_resumes_bit_exact(tmp_path, algorithm):
    """PPO included: the critic's weights and optimizer are part of the checkpoint."""
    settings = ("schedule.sft_steps=5", "logging.checkpoint_every=2", "logging.tensorboard=false", *algorithm)
    reference = tmp_path / "uninterrupted"
    assert _run(_demo_command(reference, 6, *settings), tmp_path / "a.log").returncode == 0

    resumed = tmp_path / "resumed"
    with (tmp_path / "b.log").open("w") as log:
        job = subprocess.Popen(_demo_command(resumed, 6, *settings), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        pointer = resumed / "checkpoints" / "latest"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None:
            if pointer.exists() and pointer.read_text().strip() == "step_4":
                break
            time.sleep(0.2)
        assert job.poll() is None, "the run ended before it could be killed"
        os.killpg(job.pid, signal.SIGKILL)  # the whole job: launcher, torchrun, both trainer ranks
        job.wait()
    killed_rows = _metrics(resumed)
    assert killed_rows and killed_rows[-1]["step"] >= 3
    assert _run(_demo_command(resumed, 6, *settings), tmp_path / "c.log").returncode == 0

    expected, got = _metrics(reference), _metrics(resumed)
    assert [r["step"] for r in got] == list(range(6))
    for want, have in zip(expected[4:], got[4:]):
        for key in TIMING_KEYS:
            want.pop(key, None), have.pop(key, None)
        assert have == want, f"step {want['step']} differs after resume"
