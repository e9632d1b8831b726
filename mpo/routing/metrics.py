"""Routing consistency metrics, per MoE layer and overall, over the real (non-padding) tokens.

Compared per token at its input position (the routing decision itself, not the scored-token alignment):

* ``{prefix}/exact_match``: fraction of (token, layer) pairs whose top-K *sets* are equal;
* ``{prefix}/overlap``: mean |set_a & set_b| / K;
* ``{prefix}/changed_any_layer``: fraction of tokens whose set differs in at least one layer;
* ``{prefix}/layer{l}/exact_match`` and ``.../overlap`` per global layer number l;
* :func:`replay_forced_metrics`: replayed experts vs the router's natural top-K in the same forward (R2/R3);
* :func:`router_shift_metrics`: ``{prefix}/router_abs_logdiff`` (and per layer) = mean |log p_new - log p_old| of the
  router's full-softmax probabilities at the old top-K experts.

Pairs where either side has no record (-1, e.g. the last token of a sequence under R3) are excluded. Under pipeline
parallelism pass ``pp_group``: per-layer sums are all-reduced over a vector of all ``num_layers`` layers and the
per-token "changed in any layer" flags with MAX, so every stage returns the same global numbers (a collective).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mpo.parallel.collectives import all_reduce_
from mpo.routing.records import MicroBatchRouting
from mpo.routing.rspo import current_logp_at_old


def _reduce(t: Tensor, op, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        all_reduce_(t, op=op, group=group)
    return t


def _layer_vector(values: Tensor, layers: tuple[int, ...], num_layers: int) -> Tensor:
    out = torch.zeros(num_layers, dtype=torch.float64)
    out[torch.tensor(layers) - 1] = values.to(torch.float64).cpu()
    return out


def agreement_metrics(reference: Sequence[MicroBatchRouting], other: Sequence[MicroBatchRouting],
                      valid: Sequence[Tensor], *, prefix: str, num_layers: int | None = None,
                      pp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Top-K set agreement between two routings of the same micro-batches.

    Args:
        reference / other: per micro-batch records; `other` may cover more layers (only reference's are compared).
        valid: per micro-batch ``[b, s]`` bool, True at real tokens (False at padding).
        num_layers: total MoE layers over all stages (default: the largest local layer number).
    """
    layers = reference[0].layers
    num_layers = num_layers or max(layers)
    n, exact, overlap = (torch.zeros(len(layers), dtype=torch.float64) for _ in range(3))
    changed_tokens = counted_tokens = 0.0
    for ref, oth, ok in zip(reference, other, valid, strict=True):
        # records live on the host between uses (mpo.routing.records.host_copy): one micro-batch at a time on the
        # device of the masks, where the pipeline collective below runs
        a = ref.indices.to(ok.device).long()
        c = oth.select(layers).indices.to(ok.device).long()
        k = a.shape[-1]
        recorded = (a >= 0).all(-1) & (c >= 0).all(-1) & ok.to(torch.bool)[..., None]  # [b, s, L]
        common = (a[..., :, None] == c[..., None, :]).any(-1).sum(-1)  # [b, s, L]
        same = common == k
        w = recorded.to(torch.float64)
        n += w.sum((0, 1)).cpu()
        exact += (w * same).sum((0, 1)).cpu()
        overlap += (w * common / k).sum((0, 1)).cpu()
        # Token-level flags, combined across stages with MAX before counting.
        flags = torch.stack([(recorded & ~same).any(-1), recorded.any(-1)]).to(torch.float64)
        _reduce(flags, dist.ReduceOp.MAX, pp_group)
        changed_tokens += flags[0].sum().item()
        counted_tokens += flags[1].sum().item()
    sums = torch.stack([_layer_vector(x, layers, num_layers) for x in (n, exact, overlap)])
    _reduce(sums, dist.ReduceOp.SUM, pp_group)
    n_l, exact_l, overlap_l = sums
    out = {
        f"{prefix}/exact_match": (exact_l.sum() / n_l.sum().clamp(min=1)).item(),
        f"{prefix}/overlap": (overlap_l.sum() / n_l.sum().clamp(min=1)).item(),
        f"{prefix}/changed_any_layer": changed_tokens / max(counted_tokens, 1.0),
        f"{prefix}/tokens": counted_tokens,
    }
    for i in range(num_layers):
        if n_l[i] > 0:
            out[f"{prefix}/layer{i + 1}/exact_match"] = (exact_l[i] / n_l[i]).item()
            out[f"{prefix}/layer{i + 1}/overlap"] = (overlap_l[i] / n_l[i]).item()
    return out


def replay_forced_metrics(records: Sequence[MicroBatchRouting], valid: Sequence[Tensor], *, prefix: str,
                          num_layers: int | None = None,
                          pp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """How much replay overrode the router: agreement of the replayed experts with the router's natural top-K in the
    same forward (``{prefix}/exact_match`` ...), and ``{prefix}/forced_frac`` = 1 - exact_match. Records captured
    without replay have no natural record and give an empty dict (nothing was forced)."""
    if any(r.natural is None for r in records):
        return {}
    out = agreement_metrics([r.replayed_choice() for r in records], [r.natural_choice() for r in records], valid,
                            prefix=prefix, num_layers=num_layers, pp_group=pp_group)
    out[f"{prefix}/forced_frac"] = 1.0 - out[f"{prefix}/exact_match"]
    return out


def router_shift_metrics(old: Sequence[MicroBatchRouting], new: Sequence[MicroBatchRouting],
                         valid: Sequence[Tensor], *, prefix: str, num_layers: int | None = None,
                         pp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Mean |log p_new - log p_old| of the router at the old top-K experts, per layer and overall."""
    layers = old[0].layers
    num_layers = num_layers or max(layers)
    n, total = (torch.zeros(len(layers), dtype=torch.float64) for _ in range(2))
    for o, c, ok in zip(old, new, valid, strict=True):
        o, c = o.to(ok.device), c.to(ok.device)  # host records, one micro-batch at a time on the device
        delta = (current_logp_at_old(o, c).double() - o.logp.double()).abs().mean(-1)  # [b, s, L]
        w = ok.to(delta.device, torch.float64)[..., None].expand_as(delta)
        n += w.sum((0, 1)).cpu()
        total += (w * delta).sum((0, 1)).cpu()
    sums = torch.stack([_layer_vector(n, layers, num_layers), _layer_vector(total, layers, num_layers)])
    _reduce(sums, dist.ReduceOp.SUM, pp_group)
    out = {f"{prefix}/router_abs_logdiff": (sums[1].sum() / sums[0].sum().clamp(min=1)).item()}
    for i in range(num_layers):
        if sums[0, i] > 0:
            out[f"{prefix}/layer{i + 1}/router_abs_logdiff"] = (sums[1, i] / sums[0, i]).item()
    return out


def valid_input_positions(lengths: Tensor, seq_len: int) -> Tensor:
    """``[b, s]`` True at the first lengths[i] positions of each right-padded row."""
    return torch.arange(seq_len)[None, :] < lengths[:, None]
