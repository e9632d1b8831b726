"""`mpo demo`, the README's main job, as a user runs it (real processes: torchrun, a gloo rank, an engine server):
reward rises with RL, and a run killed after a checkpoint resumes to exactly the metrics of an uninterrupted run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers.procs import gone_within, live_processes_with_env
from helpers.wandb_files import wandb_history, wandb_offline

RUN_MARKER = "MPO_DEMO_TEST_RUN"

# Wall-clock measurements differ between runs by nature; everything else must be identical after a resume.
TIMING_KEYS = ("rollout_time_s", "rollout_tokens_per_s", "train_time_s", "train_tokens_per_s", "sync_time_s",
               "sync_bytes_per_s", "schedule/wait_s", "schedule/step_s", "engine_busy_frac", "overlap_frac")


def _demo_command(out: Path, steps: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "mpo.cli", "demo", "--steps", str(steps), "--out", str(out),
            "logging.progress=false", *overrides]


def _run(command: list[str], log: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    with log.open("w") as f:
        return subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _rl_rows(out: Path) -> list[dict]:
    """The RL steps' rows (`mpo demo` evaluates held-out prompts, eval.every=20: the final evaluation has a row of
    its own, step = schedule.steps, with eval metrics only)."""
    return [r for r in _metrics(out) if "reward_mean" in r]


def _eval_steps(out: Path) -> list[int]:
    return [r["step"] for r in _metrics(out) if "eval/mean@4" in r]


def test_ppo_with_a_critic_raises_the_reward_with_colocated_engines(tmp_path):
    """PPO on the demo task: GAE advantages from the megatron critic (mpo/recipes/demo_cpu_ppo.yaml's algorithm);
    the critic is scored and trained every step, and the policy's reward rises over a short run.

    With rollout.colocate=true: the engine releases its memory after each batch and resumes it in two stages around
    the weight sync (it refuses to generate or take weights while released, so a wrong order fails the run), and
    every trainer rank offloads policy, critic and both optimizers while the engine generates (offload/bytes).
    One run covers both, and the demo's own outputs (the plot, the "before RL" line), to keep the suite short."""
    out = tmp_path / "ppo"
    overrides = ("algorithm.loss=grpo", "algorithm.advantage=gae", "algorithm.advantage_args={lam: 0.95}",
                 "algorithm.critic_lr=0.002", "algorithm.filter_zero_variance=false", "logging.tensorboard=false",
                 "rollout.colocate=true")
    result = _run(_demo_command(out, 24, *overrides), tmp_path / "ppo.log")
    log = (tmp_path / "ppo.log").read_text()
    assert result.returncode == 0, log[-3000:]
    rows = _rl_rows(out)
    assert [r["step"] for r in rows] == list(range(24))
    # The demo's held-out evaluation (`mpo demo` sets eval.every=20): before steps 0 and 20, after the last step.
    evals = [r for r in _metrics(out) if "eval/mean@4" in r]
    assert [r["step"] for r in evals] == [0, 20, 24]
    assert all(0 <= r["eval/pass@1"] <= r["eval/pass@4"] <= 1 and 0 <= r["eval/mean@4"] <= 1 for r in evals)
    assert len((out / "eval.jsonl").read_text().splitlines()) == 3 * 64  # eval.prompts rows per evaluation
    before = sum(r["reward_mean"] for r in rows[:5]) / 5
    after = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert after > before + 0.03, f"reward did not rise: first 5 steps {before:.3f}, last 5 {after:.3f}"
    assert all(math.isfinite(r["critic/value_loss"]) and r["critic/grad_norm"] > 0 for r in rows)
    assert all(r["offload/bytes"] > 0 for r in rows)
    assert "before RL" in log and "held-out mean@4" in log and (out / "demo.png").stat().st_size > 1000
    assert all(r["train_rollout_logprob_absdiff"] < 1e-5 for r in rows if "train_rollout_logprob_absdiff" in r)


PPO = ("algorithm.loss=grpo", "algorithm.advantage=gae", "algorithm.filter_zero_variance=false")


def test_killed_run_resumes_bit_exact(tmp_path, monkeypatch):
    """With PPO's critic, the most state a demo run has: policy and critic weights and optimizers, RNG, the task's
    position, the advantage estimator's state. (A GRPO-only case was dropped to keep the suite in budget: its
    state is a subset of this one, and the async test below resumes a GRPO run after a kill.)

    With algorithm.dynamic_sampling (issue 27): steps draw further rounds of prompt groups (their own prompts and
    seeds) until all 16 groups have non-zero reward variance, so every step trains on a full batch
    (kept_samples_frac 1.0) or says the rounds ran out, and the resumed steps draw the same rounds. The
    uninterrupted run also logs to W&B offline (logging.wandb): its run directory under the out dir holds every
    metrics row. An lr schedule for policy and critic, weight decay and held-out evaluations resume exactly too.

    Rollouts and evaluations stream (issue 31): calls of 4 prompt groups, 2 in flight on the one engine, scored as
    they land; the resumed run still reproduces the uninterrupted one."""
    settings = ("schedule.sft_steps=5", "logging.checkpoint_every=2", "logging.tensorboard=false", *PPO,
                "rollout.prompts_per_call=4", "rollout.max_inflight_per_engine=2",
                "algorithm.dynamic_sampling=true",
                "schedule.lr_warmup_steps=2", "schedule.lr_decay=cosine", "schedule.min_lr=0.0002",
                "schedule.weight_decay=0.01", "algorithm.critic_lr=0.002", "eval.every=2", "eval.prompts=16")
    with_wandb = importlib.util.find_spec("wandb") is not None  # the mpo[wandb] extra (tests/requirements-ci.txt)
    if with_wandb:
        wandb_offline(monkeypatch, tmp_path)
    reference = tmp_path / "uninterrupted"
    assert _run(_demo_command(reference, 6, *settings, *(("logging.wandb=true",) if with_wandb else ())),
                tmp_path / "a.log").returncode == 0, (tmp_path / "a.log").read_text()[-3000:]
    rows = _metrics(reference)  # the RL steps' rows and the final evaluation's
    rl_rows = [r for r in rows if "reward_mean" in r]
    assert all(r["kept_samples_frac"] == 1.0 or r["sampling_exhausted"] == 1.0 for r in rl_rows), rl_rows
    assert any(r["sampling_rounds"] > 1 for r in rl_rows)  # this run's seeds: zero-variance groups were replaced
    if with_wandb:
        (run_dir,) = (reference / "wandb").glob("offline-run-*")
        assert wandb_history(run_dir) == {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in rows}

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
    assert [r["step"] for r in got] == list(range(7))  # 6 RL steps and the final evaluation's row
    assert _eval_steps(resumed) == [0, 2, 4, 6]
    for want, have in zip(expected[4:], got[4:]):
        for key in (*TIMING_KEYS, "eval/time_s"):
            want.pop(key, None), have.pop(key, None)
        assert have == want, f"step {want['step']} differs after resume"
    for row in got[:6]:  # megatron-LM's warmup then cosine, written out: lr * s / 2, then the cosine to min_lr
        s = row["step"]
        lr = 1e-3 * s / 2 if s <= 2 else 2e-4 + (1e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * (s - 2) / 4))
        # the critic: the same shape from its own peak (critic_lr 2e-3), its floor scaled alike (4e-4)
        assert row["lr"] == pytest.approx(lr, rel=1e-9, abs=1e-15)
        assert row["critic_lr"] == pytest.approx(2 * lr, rel=1e-9, abs=1e-15)


def _versions(out: Path) -> dict[int, dict]:
    """versions.jsonl: per step, per consumed sample, the oldest and newest policy version its tokens were sampled
    under and how often it changes along the response (rank 0 summarised what the mpo engine stamped per token)."""
    rows = [json.loads(line) for line in (out / "versions.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def _ages(out: Path) -> list[int]:
    """Each consumed sample's oldest and newest token age (versions are integers, so every age lies between)."""
    return [step - v for step, row in _versions(out).items() for lo, hi in zip(row["min"], row["max"])
            if lo is not None for v in (lo, hi)]


def test_one_step_off_raises_the_reward_one_version_behind(tmp_path):
    """schedule.mode=one_step_off: step n+1's rollouts are generated while step n trains, weights reach the engine
    between batches: every consumed token is at most one version old (and some are), the engine was generating
    during training, and RL still raises the reward."""
    out = tmp_path / "off"
    # eval.every=0: nothing here reads the held-out evaluations (the other demo runs assert them), which would
    # otherwise generate 2 x 256 responses before step 0 and after the last
    result = _run(_demo_command(out, 20, "schedule.mode=one_step_off", "logging.tensorboard=false", "eval.every=0"),
                  tmp_path / "off.log")
    assert result.returncode == 0, (tmp_path / "off.log").read_text()[-3000:]
    rows = _rl_rows(out)
    ages = _ages(out)
    assert set(ages) == {0, 1}  # 0 only where the trainer caught up with the producer (step 0, say)
    assert max(r["staleness_max"] for r in rows) == 1
    assert sum(r["overlap_frac"] for r in rows[1:]) / (len(rows) - 1) > 0.05
    before = sum(r["reward_mean"] for r in rows[:5]) / 5
    after = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert after > before + 0.03, f"reward did not rise: first 5 steps {before:.3f}, last 5 {after:.3f}"


def test_async_bounds_staleness_survives_a_kill_and_raises_the_reward(tmp_path):
    """schedule.mode=async, max_staleness=2: the producer keeps the engine busy and weight updates reach it in
    flight (a response may mix two versions, stamped per token by the engine). The run is SIGKILLed mid-run (the
    producer has rollouts in flight, often while an update is being pushed), restarted, and finishes: every step once,
    no consumed token staler than 2 versions (from the logged per-token versions), and the reward rises.

    The restarted run is also the suite's finished async run (tests/test_hardening_lifecycle.py kills its own):
    rank 0's rollouts were collected in a child process of its own (mpo.trainer.producer), and once the run has
    finished no process it started is left."""
    out = tmp_path / "async"
    settings = ("schedule.mode=async", "schedule.max_staleness=2", "logging.checkpoint_every=4",
                "logging.tensorboard=false")
    with (tmp_path / "a.log").open("w") as log:
        job = subprocess.Popen(_demo_command(out, 20, *settings), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        pointer = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None:
            if pointer.exists() and pointer.read_text().strip() == "step_8":
                break
            time.sleep(0.05)
        assert job.poll() is None, "the run ended before it could be killed"
        time.sleep(0.3)  # into the next steps: the producer is generating, an update may be in flight
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    run_id = uuid.uuid4().hex  # in the environment of every process the restarted run starts: found in /proc
    with (tmp_path / "b.log").open("w") as log:
        code = subprocess.run(_demo_command(out, 20, *settings), stdout=log, stderr=subprocess.STDOUT, timeout=600,
                              env={**os.environ, RUN_MARKER: run_id}).returncode
    text = (tmp_path / "b.log").read_text()
    assert code == 0, text[-3000:]
    left = live_processes_with_env(RUN_MARKER, run_id)
    assert not gone_within(list(left), 10.0), f"processes of the finished run still alive: {left}"
    producer = re.search(r"rank(\d+) INFO rollout producer: process (\d+)", text)
    assert producer and producer[1] != producer[2], text[-3000:]
    rows = _rl_rows(out)
    assert [r["step"] for r in rows] == list(range(20))
    assert _eval_steps(out) == [0, 20]  # held-out evaluations in async mode, across the kill
    versions = _versions(out)
    assert sorted(versions) == list(range(20))
    ages = _ages(out)
    assert max(ages) <= 2 and max(r["staleness_max"] for r in rows) <= 2
    assert max(ages) >= 1  # off-policy for real: the producer ran ahead of the trainer
    # Whether some response spans an in-flight update is a race (109 of 2,560 responses in one run, 0 in another
    # under CI's load), so it is reported, not asserted; the staleness bound above holds either way.
    mixed = sum(changes > 0 for row in versions.values() for changes in row["changes"])
    print(f"responses generated across an in-flight weight update: {mixed}")
    before = sum(r["reward_mean"] for r in rows[:5]) / 5
    after = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert after > before + 0.03, f"reward did not rise: first 5 steps {before:.3f}, last 5 {after:.3f}"


def test_hardening_dp2_demo_runs_and_resumes_an_ep2_checkpoint(tmp_path):
    """Pure data parallelism (parallel.expert_parallel=1: 2 ranks, each the whole model), the layout most users run:
    it crashed at the first weight sync (rank 1 holds no main copy of any weight: IndexError in the streamer, issue
    #24). Here an EP2 run checkpoints at step 2 and the same run directory continues at DP2: the checkpoint is
    resharded to the new layout, every step from there trains and syncs, and the log says where it resumed."""
    out = tmp_path / "run"
    settings = ("schedule.sft_steps=3", "logging.checkpoint_every=2", "logging.tensorboard=false", "eval.every=0")
    assert _run(_demo_command(out, 2, *settings, "world_size=2", "parallel.expert_parallel=2"),
                tmp_path / "ep2.log").returncode == 0
    result = _run(_demo_command(out, 4, *settings, "world_size=2", "logging.phase_times=true"),
                  tmp_path / "dp2.log")
    log = (tmp_path / "dp2.log").read_text()
    assert result.returncode == 0, log[-3000:]
    assert "resumed from" in log and "(step 2)" in log
    # quiet start-up (mpo.quiet): megatron's and torch's notices a CPU user cannot act on are gone; one line says
    # what runs instead
    for noise in ("IS DEPRECATED", "async save is deprecated", "No CUDA runtime", "Apex"):
        assert noise not in log, noise
    assert log.count("model: megatron-core GPTModel, local layer spec") == 1
    rows = _rl_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["sync_bytes"] > 0 for r in rows[2:])
    # logging.phase_times (the DP2 leg only): each step's phases are disjoint spans inside its wall time
    assert not any(k.startswith("time/") for r in rows[:2] for k in r)
    top = ("eval", "collect", "broadcast", "microbatch_build", "old_logprob_pass", "update0", "update1",
           "metrics_gather", "sync", "metrics_write", "checkpoint")
    for r in rows[2:]:
        assert all(r[f"time/{name}_s"] > 0 for name in ("collect", "engine", "old_logprob_pass", "update0", "sync"))
        assert r["time/engine_s"] + r["time/http_and_decode_s"] <= r["time/collect_s"] + 1e-6
        assert sum(r.get(f"time/{name}_s", 0.0) for name in top) <= r["schedule/step_s"] + 1e-6, r
