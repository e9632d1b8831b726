"""FP32 LM head: with a bf16 body, log-probs from an fp32 head are closer to an all-fp32 model than from a bf16 head;
the head stays fp32 through Float16Module, megatron DDP and a megatron optimizer step; tied embeddings work; and it
composes with tensor parallelism (vocab-parallel head at TP2)."""

from __future__ import annotations

import pytest
import torch

from helpers import precision_worker
from helpers.spawn import spawn_ranks


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision")
    spawn_ranks(1, precision_worker.run, str(out), {}, True)
    spawn_ranks(2, precision_worker.run, str(out), {"tensor_parallel": 2}, False)
    return {path.stem: torch.load(path, weights_only=True) for path in out.glob("precision_*.pt")}


def _errors(run, reference):
    mask = torch.ones_like(reference, dtype=torch.bool)
    mask[:, 0] = False
    return {name: (run[name] - reference)[mask].abs().mean().item() for name in ("bf16_fp32head", "bf16_bf16head")}


@pytest.mark.parametrize("layout", ["tp1", "tensor_parallel2"])
def test_fp32_head_is_closer_to_fp32_reference(precision_runs, layout):
    reference = precision_runs["precision_tp1"]["fp32"]
    errors = _errors(precision_runs[f"precision_{layout}"], reference)
    # Both errors are real (the bf16 body costs something); the fp32 head removes the head's share. Measured here:
    # mean |dlogp| 2.6e-3 (fp32 head) vs 6.6e-3 (bf16 head) at TP1.
    assert errors["bf16_fp32head"] > 0
    assert errors["bf16_fp32head"] < 0.7 * errors["bf16_bf16head"], errors


@pytest.mark.parametrize("layout", ["tp1", "tensor_parallel2"])
def test_fp32_head_survives_ddp_optimizer_and_tied_embeddings(precision_runs, layout):
    run = precision_runs[f"precision_{layout}"]
    assert run["ddp_step_ok"] and run["tied_ok"]
