"""Two real gloo data-parallel ranks: all-reduced denominators and gradients equal the single-process full batch.

One spawn runs every (loss, aggregation) pair; each pair is then checked as its own test. The model is
``logp_new = P * scale`` with ``P`` and ``scale`` replicated on both ranks, so the all-reduced (SUM) parameter gradient
mixes both ranks' rows like a real DP all-reduce. Padding holds finite garbage here: a NaN inside the model itself
would make d(P*scale)/dscale NaN whatever the loss does.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loss_batches import B, loss_config, make_batch, random_batch
from mpo.parallel.ports import free_port
from mpo.algorithms import (
    AGG_MODES,
    all_reduce_metrics,
    compute_global_denominators,
    compute_policy_loss,
    loss_names,
    merge_metrics,
)

WORLD = 2
RANK_ROWS = [slice(0, 5), slice(5, B)]  # groups 1 and 2 straddle the ranks
MICRO_BATCHES = {0: [slice(0, 2), slice(2, 5)], 1: [slice(5, 8), slice(8, B)]}
CASES = [(name, agg) for name in loss_names() for agg in AGG_MODES]
# Rollout corrections (with the engine's log-probs): denominators over the kept tokens, counts all-reduced.
CORRECTED = [("grpo", "token-mean", "mis_seq"), ("gspo", "seq-mean-token-mean", "tis_seq"),
             ("dppo_kl", "token-mean", "icepop_token"), ("cispo", "prompt-mean-token-mean", "tis_token")]


def _step(name, agg, data, micro_batches, process_group, correction=None):
    """One optimizer step's gradient for P and scale (+ metrics) over the given micro-batches."""
    from mpo.algorithms import CorrectionConfig, apply_rollout_correction, correction_counts

    P = data["logp_new"].clone().requires_grad_(True)
    scale = torch.ones((), dtype=torch.float64, requires_grad=True)
    cfg = loss_config(name, agg)
    batches = [make_batch(data, mb, P[mb] * scale, with_rollout=correction is not None) for mb in micro_batches]
    masks, counts = [b.mask for b in batches], None
    if correction is not None:
        correction = CorrectionConfig(correction)
        corrections = [apply_rollout_correction(b.logp_old, b.logp_rollout, b.mask, correction) for b in batches]
        counts = correction_counts(masks, corrections, process_group)
        masks = [c.mask_out for c in corrections]
    denoms = compute_global_denominators(masks, [b.group_ids for b in batches],
                                         [b.advantages for b in batches], num_groups=5, process_group=process_group)
    metrics = []
    for b in batches:
        out = compute_policy_loss(name, b, cfg, denoms, correction=correction, correction_counts=counts)
        out.loss.backward()
        metrics.append(out.metrics)
    grads = torch.cat([P.grad.reshape(-1), scale.grad.reshape(1)])
    return grads, merge_metrics(metrics)


def _worker(rank: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        data = random_batch(seed=3, garbage=1e4)
        results = {}
        for case in [*CASES, *CORRECTED]:
            grads, metrics = _step(*case[:2], data, MICRO_BATCHES[rank], dist.group.WORLD, *case[2:])
            dist.all_reduce(grads, op=dist.ReduceOp.SUM)
            results[case] = (grads, all_reduce_metrics(metrics, dist.group.WORLD))
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    out_path = str(tmp_path_factory.mktemp("dp") / "results.pt")
    mp.start_processes(_worker, args=(free_port(), out_path), nprocs=WORLD, join=True, start_method="spawn")
    return torch.load(out_path)


@pytest.mark.parametrize("name,agg", CASES, ids=[f"dp-gloo-{n}-{a}" for n, a in CASES])
def test_dp_gloo_matches_full_batch(dp_results, name, agg):
    grads, metrics = dp_results[(name, agg)]
    full_grads, full_metrics = _step(name, agg, random_batch(seed=3, garbage=1e4), [slice(0, B)], None)
    assert torch.count_nonzero(full_grads) > 0
    torch.testing.assert_close(grads, full_grads, rtol=0, atol=1e-12)
    assert set(metrics) == set(full_metrics)
    for key, value in full_metrics.items():
        torch.testing.assert_close(metrics[key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize("name,agg,kind", CORRECTED, ids=[f"dp-gloo-correction-{n}-{k}" for n, _, k in CORRECTED])
def test_dp_gloo_corrected_matches_full_batch(dp_results, name, agg, kind):
    grads, metrics = dp_results[(name, agg, kind)]
    full_grads, full_metrics = _step(name, agg, random_batch(seed=3, garbage=1e4), [slice(0, B)], None, kind)
    assert torch.count_nonzero(full_grads) > 0 and "rollout_is_weight_mean" in full_metrics
    torch.testing.assert_close(grads, full_grads, rtol=0, atol=1e-12)
    for key, value in full_metrics.items():
        torch.testing.assert_close(metrics[key], value, rtol=0, atol=1e-12, msg=key)
