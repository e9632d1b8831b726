"""What the GPU tier does on a machine without CUDA (this suite's machines): tests/gpu is collected and skipped with
one reason, but FAILS under MPO_GPU_TIER=1 (how tests/gpu/run.sh runs it); `python -m mpo.bench gpu_step` exits
non-zero with one line; and the benchmark's parameter count, which its MFU rests on, matches transformers' own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU tier's behaviour without CUDA")


@cpu_only
def test_gpu_tier_is_collected_and_skipped_with_one_reason():
    env = {k: v for k, v in os.environ.items() if k != "MPO_GPU_TIER"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-ra", "-p",
                          "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**env, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout + run.stderr
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "GPU TIER SKIPPED: no CUDA device" in skipped[0], run.stdout
    assert " skipped" in run.stdout.splitlines()[-1] and "passed" not in run.stdout.splitlines()[-1], run.stdout


@cpu_only
def test_gpu_tier_fails_without_cuda_when_run_as_the_gpu_tier(monkeypatch):
    """The gate itself, in this process (the subprocess run above proves it is wired to every test of the tier)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_tier_conftest", REPO / "tests" / "gpu" / "conftest.py")
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)
    monkeypatch.setenv("MPO_GPU_TIER", "1")
    with pytest.raises(pytest.fail.Exception, match=r"GPU TIER BROKEN \(MPO_GPU_TIER=1\): torch.cuda.is_available"):
        gate._gate()
    monkeypatch.delenv("MPO_GPU_TIER")
    with pytest.raises(pytest.skip.Exception, match="GPU TIER SKIPPED: no CUDA device"):
        gate._gate()


@cpu_only
def test_gpu_step_bench_needs_cuda(capsys):
    from mpo.bench.__main__ import main

    assert main(["gpu_step"]) != 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().count("\n") == 0 and "needs a CUDA device" in captured.err


def test_gpu_step_parameter_count_matches_transformers():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mpo.bench.gpu_step import parameter_counts, train_flops_per_token
    from mpo.models.config import preset, to_hf_config

    cfg = preset("gpu_1b")
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**to_hf_config(cfg)))
    counts = parameter_counts(cfg)
    assert counts.total == sum(p.numel() for p in hf.parameters())
    assert 1e9 <= counts.total <= 2e9, counts  # the issue's ~1-2B-parameter MoE
    # Active matmul weights: per layer attention + router + top-k of the experts, plus the LM head.
    attention = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim * cfg.hidden_size \
        + cfg.hidden_size * cfg.num_attention_heads * cfg.head_dim
    experts = cfg.router_topk * 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size
    router = cfg.num_experts * cfg.hidden_size
    assert counts.active_matmul == cfg.num_layers * (attention + experts + router) + cfg.vocab_size * cfg.hidden_size
    assert train_flops_per_token(cfg, 2048) > 6 * counts.active_matmul


def test_cuda_ipc_payload_has_the_fields_of_mpos_flattened_bucket():
    """tests/gpu/sync_worker builds SGLang's flattened bucket without moving it to the host (for CUDA IPC); on host
    tensors it must equal mpo.rollout.sglang_wire.flatten_bucket's payload, field for field."""
    import importlib.util

    from mpo.rollout.sglang_wire import flatten_bucket

    spec = importlib.util.spec_from_file_location("gpu_sync_worker", REPO / "tests" / "gpu" / "sync_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    run = [("a.weight", torch.randn(3, 4)), ("b.weight", torch.randn(5)), ("c.weight", torch.randn(2, 2, 2))]
    ours, reference = worker.cuda_flattened_bucket(run), flatten_bucket(run)
    assert torch.equal(ours["flattened_tensor"], reference["flattened_tensor"])
    assert [vars(m) for m in ours["metadata"]] == [vars(m) for m in reference["metadata"]]
