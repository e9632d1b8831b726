"""The Transformer Engine layer spec computes what megatron-core's local spec computes, on the same weights.

One GPU, NCCL world of 1: a tiny random Qwen3-MoE (HF, fp32) converted with checkpoints_tools, loaded into both
specs at fp32 and at bf16 (FP32 LM head). fp32: logits and log-probs equal within 1e-5. bf16: TE's error against the
fp32 model is of the same size as the local spec's (both round the same bf16 weights; kernels differ).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers.spawn import spawn_ranks
from helpers.tiny_hf import make_tiny_qwen3_moe

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    import te_parity_worker
    from checkpoints_tools import hf_to_mcore
    from tier import needs_te

    needs_te()
    work = tmp_path_factory.mktemp("te_spec")
    hf_dir = make_tiny_qwen3_moe(work / "hf", seed=5, vocab=256)
    hf_to_mcore(hf_dir, work / "mc", show_progress=False)
    rows = torch.randint(4, 256, (4, 48), generator=torch.Generator().manual_seed(0)).tolist()
    spawn_ranks(1, te_parity_worker.run, str(work / "out.pt"), str(work / "mc"), rows)
    return torch.load(work / "out.pt", weights_only=False)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_the_te_model_is_built_from_te_modules(outputs):
    te, local = set(outputs["te_fp32"]["modules"]), set(outputs["local_fp32"]["modules"])
    assert any(name.startswith("TE") for name in te - local), f"no Transformer Engine module in the TE model: {te}"


def test_fp32_te_equals_local(outputs):
    te, local = outputs["te_fp32"], outputs["local_fp32"]
    logits, logprobs = _maxdiff(te["logits"], local["logits"]), _maxdiff(te["logprobs"], local["logprobs"])
    routes = (te["routes"].sort(-1).values == local["routes"].sort(-1).values).all(-1).float().mean().item()
    print(f"\n[gpu] fp32 TE vs local: max |logits diff| {logits:.2e}, max |log-prob diff| {logprobs:.2e}, "
          f"routes equal on {routes:.4f} of (token, layer)", file=sys.stderr)
    assert logits <= FP32_TOL and logprobs <= FP32_TOL
    assert routes == 1.0


def test_bf16_te_is_as_close_to_fp32_as_local(outputs):
    reference = outputs["local_fp32"]["logprobs"]
    err = {spec: (outputs[f"{spec}_bf16"]["logprobs"] - reference).abs().mean().item() for spec in ("te", "local")}
    between = (outputs["te_bf16"]["logprobs"] - outputs["local_bf16"]["logprobs"]).abs()
    print(f"\n[gpu] bf16 log-probs vs fp32: mean |diff| TE {err['te']:.2e}, local {err['local']:.2e}; TE vs local "
          f"mean {between.mean().item():.2e} max {between.max().item():.2e}", file=sys.stderr)
    # bf16's unit roundoff is 2^-8: a few of them per log-prob is bf16 tolerance; a wrong kernel or key is O(1).
    assert err["te"] <= 2 * err["local"] + 1e-3
    assert between.mean().item() <= 2e-2 and between.max().item() <= 0.25
