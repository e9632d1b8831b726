"""Gradient accumulation: micro-batches with global denominators give exactly the full-batch loss, gradient and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from loss_batches import B, make_batch, loss_config, random_batch
from mpo.algorithms import AGG_MODES, compute_global_denominators, compute_policy_loss, loss_names, merge_metrics

MICRO_BATCHES = [slice(0, 4), slice(4, 5), slice(5, 9), slice(9, B)]
CASES = [(name, agg) for name in loss_names() for agg in AGG_MODES]


def full_and_accumulated(name: str, agg: str):
    data = random_batch(seed=1)
    cfg = loss_config(name, agg)
    full_param = data["logp_new"].clone().requires_grad_(True)
    full = compute_policy_loss(name, make_batch(data, slice(0, B), full_param), cfg)
    full.loss.backward()

    micro_masks = [make_batch(data, mb, data["logp_new"][mb]).mask for mb in MICRO_BATCHES]
    micro_adv = [make_batch(data, mb, data["logp_new"][mb]).advantages for mb in MICRO_BATCHES]
    denoms = compute_global_denominators(micro_masks, [data["group_ids"][mb] for mb in MICRO_BATCHES], micro_adv)
    param = data["logp_new"].clone().requires_grad_(True)
    total, metrics = 0.0, []
    for mb in MICRO_BATCHES:
        out = compute_policy_loss(name, make_batch(data, mb, param[mb]), cfg, denoms)
        out.loss.backward()
        total += out.loss.item()
        metrics.append(out.metrics)
    return full, full_param.grad, total, param.grad, merge_metrics(metrics)


@pytest.mark.parametrize("name,agg", CASES, ids=[f"microbatch-{n}-{a}" for n, a in CASES])
def test_microbatches_match_full_batch(name, agg):
    full, full_grad, total, grad, metrics = full_and_accumulated(name, agg)
    assert math.isfinite(full.loss.item())
    assert torch.isfinite(full_grad).all()
    assert abs(total - full.loss.item()) < 1e-12
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-12)
    assert torch.count_nonzero(full_grad[random_batch()["mask"] == 1]) > 0, "degenerate test: no gradient"
    assert set(metrics) == set(full.metrics)
    for key, value in full.metrics.items():
        torch.testing.assert_close(metrics[key], value.detach(), rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", loss_names(), ids=[f"masking-{n}" for n in loss_names()])
def test_garbage_never_leaks(name):
    """NaN / huge garbage at masked positions changes nothing and gets exactly zero gradient."""
    results = []
    for garbage in (float("nan"), 1e4, -1e4):
        data = random_batch(seed=2, garbage=garbage)
        param = data["logp_new"].clone().requires_grad_(True)
        out = compute_policy_loss(name, make_batch(data, slice(0, B), param), loss_config(name, "token-mean"))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert torch.all(param.grad[data["mask"] == 0] == 0)
        assert all(torch.isfinite(v) for v in out.metrics.values())
        results.append((out.loss.detach(), param.grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])


CORRECTED = [(name, kind) for name in ("grpo", "gspo", "cispo", "dppo_kl")
             for kind in ("none", "tis_token", "tis_seq", "icepop_token", "mis_seq")]


@pytest.mark.parametrize("applied", [False, True], ids=["in-loss", "applied-once"])
@pytest.mark.parametrize("name,kind", CORRECTED, ids=[f"microbatch-correction-{n}-{k}" for n, k in CORRECTED])
def test_corrected_microbatches_match_full_batch(name, kind, applied):
    """Rollout correction with denominators over the kept tokens: micro-batches sum to the full-batch loss,
    gradient and metrics (the correction metrics included). applied-once: the corrections made for the denominators
    are handed to the loss (counted over the mini-batch), as the trainer does, instead of being recomputed there."""
    from mpo.algorithms import CorrectionConfig, apply_rollout_correction, correction_counts

    data = random_batch(seed=3)
    cfg, correction = loss_config(name, "token-mean"), CorrectionConfig(kind)
    full_param = data["logp_new"].clone().requires_grad_(True)
    full = compute_policy_loss(name, make_batch(data, slice(0, B), full_param, with_rollout=True), cfg,
                               correction=correction)
    full.loss.backward()
    batches = [make_batch(data, mb, data["logp_new"][mb], with_rollout=True) for mb in MICRO_BATCHES]
    corrections = [apply_rollout_correction(b.logp_old, b.logp_rollout, b.mask, correction) for b in batches]
    denoms = compute_global_denominators([c.mask_out for c in corrections], [b.group_ids for b in batches],
                                         [b.advantages for b in batches])
    counts = correction_counts([b.mask for b in batches], corrections)
    param = data["logp_new"].clone().requires_grad_(True)
    total, metrics = 0.0, []
    for mb, corrected in zip(MICRO_BATCHES, corrections):
        out = compute_policy_loss(name, make_batch(data, mb, param[mb], with_rollout=True), cfg, denoms,
                                  correction=correction, correction_counts=counts,
                                  corrected=corrected.counted(counts) if applied else None)
        out.loss.backward()
        total += out.loss.item()
        metrics.append(out.metrics)
    assert abs(total - full.loss.item()) < 1e-12
    torch.testing.assert_close(param.grad, full_param.grad, rtol=0, atol=1e-12)
    merged = merge_metrics(metrics)
    assert "rollout_mismatch_k1" in merged and "rollout_is_weight_mean" in merged
    for key, value in full.metrics.items():
        torch.testing.assert_close(merged[key], value.detach(), rtol=0, atol=1e-12, msg=key)
    if kind == "mis_seq":  # the test exercises dropping: some rows leave, some stay
        assert 0 < full.metrics["rollout_masked_frac"].item() < 1
