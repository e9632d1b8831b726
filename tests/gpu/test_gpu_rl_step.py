"""One RL step on one GPU (NCCL, world 1) with mpo's trainer, rollouts from (a) mpo's own engine and (b) a real
SGLang 0.5.23 server, bf16 body and FP32 LM head on both sides, routing replay R3.

Reported: the train-vs-rollout log-prob mean |diff| over the loss tokens against the goal (<= 1e-3; a GOAL MISSED
line says so loudly, it is a target, not a correctness bound) and the routing agreement between the engine's routed
experts and the trainer's natural choice. Checked: the step ran on CUDA with NCCL and the TE spec (megatron-core's
local spec offline: tests/gpu/run.sh --offline, where the SGLang case skips with one line); R3 replayed the
engine's routes end to end (the engine returned routes and the trainer's old-logprob pass was forced onto them); the
mismatch is at bf16-rounding level (<= 0.05: on CPU, bf16 vs fp32 of the same model is ~1e-2; wrong weights or
routes give O(0.1-1)); the weights reached the engine after the step.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from helpers.spawn import spawn_ranks

pytestmark = pytest.mark.gpu

LOGPROB_GOAL = 1e-3  # issue 18: train-vs-rollout mean |diff| with bf16 body + FP32 head on both sides
LOGPROB_BOUND = 0.05  # bf16-rounding level; beyond it the two sides do not run the same policy
GPU_OVERRIDES = ["world_size=1", "parallel.expert_parallel=1", "model.dtype=bf16", "model.fp32_lm_head=true",
                 "rollout.engine_dtype=bf16", "algorithm.replay=r3", "algorithm.filter_zero_variance=false"]


def _step(out: Path, name: str, overrides: list[str]) -> dict:
    import rl_step_worker

    spawn_ranks(1, rl_step_worker.run, str(out), name, GPU_OVERRIDES + overrides)
    return json.loads((out / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def mpo_engine_step(tmp_path_factory) -> dict:
    return _step(tmp_path_factory.mktemp("rl_mpo"), "mpo_engine", ["rollout.engine=mpo"])


@pytest.fixture(scope="module")
def sglang_step(tmp_path_factory) -> dict:
    from checkpoints_tools import hf_to_mcore
    from helpers.tiny_hf import make_tiny_qwen3_moe
    from sglang_gpu import start_gpu_sglang_server
    from tier import needs_sglang

    needs_sglang()
    work = tmp_path_factory.mktemp("rl_sglang")
    hf_dir = make_tiny_qwen3_moe(work / "hf", seed=11, vocab=256)
    hf_to_mcore(hf_dir, work / "mc", show_progress=False)
    with start_gpu_sglang_server(hf_dir) as server:
        print(f"\n[gpu] sglang ready in {server.start_seconds:.1f} s (log {server.log_path})", file=sys.stderr)
        return _step(work, "sglang", ["rollout.engine=sglang", f"rollout.urls=[{server.url}]",
                                      f"model.hf_dir={hf_dir}", f"model.mcore_dir={work / 'mc'}"])


def _check_step(result: dict, engine: str) -> None:
    from record import record

    from mpo.parallel.device import transformer_engine_problem

    device, step = result["device"], result["step"]
    diff = step["train_rollout_logprob_absdiff"]
    goal = "goal met" if diff <= LOGPROB_GOAL else "GOAL MISSED"
    record(f"rl_step_{engine.replace(' ', '_')}",
           f"{engine}: one RL step on {device['gpu']} ({device['backend']}, {device['spec']} spec): "
           f"train-vs-rollout log-prob mean |diff| {diff:.2e} ({goal}: <= {LOGPROB_GOAL:g}); routes engine vs "
           f"trainer exact match {step.get('routing/rollout_vs_old/exact_match')}, R3 forced fraction "
           f"{step.get('routing/old_replay/forced_frac')}; sync {step.get('sync_time_s')} s",
           spec=device["spec"], train_rollout_logprob_absdiff=diff, goal=LOGPROB_GOAL,
           rollout_vs_old_exact_match=step.get("routing/rollout_vs_old/exact_match"),
           r3_forced_frac=step.get("routing/old_replay/forced_frac"), sync_time_s=step.get("sync_time_s"),
           sync_bytes=step.get("sync_bytes"), loss=step.get("loss"), grad_norm=step.get("grad_norm"))
    # TE where it imports (always under the online tier), megatron-core's local spec offline
    expected_spec = "te" if transformer_engine_problem() is None else "local"
    assert device["backend"] == "nccl" and device["spec"] == expected_spec and device["device"].startswith("cuda")
    assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    # R3 end to end: the engine returned routes (agreement is measured on them) and the old pass replayed them.
    assert "routing/rollout_vs_old/exact_match" in step and "routing/old_replay/forced_frac" in step
    assert step["sync_bytes"] > 0
    assert diff <= LOGPROB_BOUND, f"{engine} vs trainer log-prob mean |diff| {diff:.3g}: not the same policy"


def test_rl_step_with_mpo_engine(mpo_engine_step):
    _check_step(mpo_engine_step, "mpo engine")


def test_rl_step_with_sglang(sglang_step):
    _check_step(sglang_step, "sglang")
    assert sglang_step["step"]["sync_probe_logprob_maxdiff"] <= 0.1  # the synced weights serve the trainer's policy
