"""RSPO router-shift inputs from two routing captures (RSPO's router-shift weight, mpo.algorithms.router_shift).

The old-logprob forward's capture gives the old top-K experts and their old router log-probs. The current forward,
captured with ``gather_at=old_records``, gives the current router's log-probs at those same experts (under R2/R3 the
current forward replays the old indices, so its own ``logp`` is already at the old experts). Both are aligned to the
scored tokens (token t <- routing at input position t-1). Under pipeline parallelism each stage holds only its layers:
:func:`router_shift` sums |delta| locally, all-reduces (SUM) over the pipeline group, and only then exponentiates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from mpo.algorithms.router_shift import RouterShift, gamma_from_sums, router_shift_sum
from mpo.parallel.collectives import all_reduce_
from mpo.routing.alignment import align_to_scored_tokens
from mpo.routing.records import MicroBatchRouting


def current_logp_at_old(old: MicroBatchRouting, new: MicroBatchRouting) -> Tensor:
    """The current router's log-probs ``[b, s, L, K]`` at the old experts, from a capture of the current forward."""
    if new.layers != old.layers:
        raise ValueError(f"captures cover different layers: old {old.layers}, new {new.layers}")
    if new.logp_at is not None:
        return new.logp_at
    if new.logp is not None and torch.equal(new.indices.long(), old.indices.long()):
        return new.logp  # replayed the old indices: logp is at the old experts already
    raise ValueError("current capture has no log-probs at the old experts: capture it with gather_at=old records "
                     "(or replay the old indices)")


def router_logp_pairs(old: MicroBatchRouting, new: MicroBatchRouting,
                      position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(router_logp_new, router_logp_old)``, each ``[b, s, L, K]`` aligned to scored tokens, for ``PolicyBatch``.

    Positions that score nothing (t = 0, packed sequence starts) hold 0 in both, so their shift is 0.
    """
    if old.logp is None:
        raise ValueError("old capture has no log-probs (CaptureConfig.record_logprobs=False)")
    new_logp = current_logp_at_old(old, new)
    return (align_to_scored_tokens(new_logp, position_ids), align_to_scored_tokens(old.logp, position_ids))


def router_shift(old: MicroBatchRouting, new: MicroBatchRouting, gamma_min: float, *,
                 position_ids: Tensor | None = None, pp_group: dist.ProcessGroup | None = None) -> RouterShift:
    """gamma ``[b, s]`` per scored token (float64), summed over all MoE layers of all pipeline stages.

    A collective over `pp_group` when given (every stage must call it for the same micro-batch, outside megatron's
    schedule); the result is identical on every stage, so the last stage can pass it to the loss as
    ``PolicyBatch.router_shift``.
    """
    logp_new, logp_old = router_logp_pairs(old, new, position_ids)
    abs_sum, count = router_shift_sum(logp_new, logp_old)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        packed = torch.stack([abs_sum, count])
        all_reduce_(packed, op=dist.ReduceOp.SUM, group=pp_group)
        abs_sum, count = packed[0], packed[1]
    return gamma_from_sums(abs_sum, count, gamma_min)
