"""Metric reductions that combine exactly across micro-batches and data-parallel ranks.

Every metric a loss returns is one of three kinds, told apart by its name:

* ``*_min`` / ``*_max``: the local min / max over valid tokens (or non-empty rows). An empty micro-batch returns the
  identity (+inf / -inf), so combining with ``min`` / ``max`` across micro-batches and ranks is exact.
* everything else is a *partial mean*: the local sum divided by the *global* count from
  :class:`~mpo.algorithms.aggregation.GlobalDenominators`. Summing partial means over micro-batches and ranks gives
  the mean over the whole mini-batch.

:func:`merge_metrics` combines micro-batches; :func:`all_reduce_metrics` combines ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from mpo.parallel.collectives import all_reduce_


def masked_partial_mean(x: Tensor, valid: Tensor, global_count: float | None) -> Tensor:
    """sum(x over valid) / global_count (0 when the global count is 0)."""
    total = torch.where(valid, x, torch.zeros_like(x)).sum()
    if not global_count:
        return torch.zeros_like(total)
    return total / global_count


def masked_min(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x, torch.full_like(x, float("inf"))).amin() if x.numel() else x.new_tensor(float("inf"))


def masked_max(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x, torch.full_like(x, float("-inf"))).amax() if x.numel() else x.new_tensor(float("-inf"))


def stats(prefix: str, x: Tensor, valid: Tensor, global_count: float | None) -> dict[str, Tensor]:
    """``{prefix}_mean``, ``{prefix}_min`` and ``{prefix}_max`` of x over valid entries."""
    return {
        f"{prefix}_mean": masked_partial_mean(x, valid, global_count),
        f"{prefix}_min": masked_min(x, valid),
        f"{prefix}_max": masked_max(x, valid),
    }


def _reduce_kind(name: str) -> str:
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return "sum"


def merge_metrics(per_micro_batch: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine the metric dicts of the micro-batches of one optimizer step (sum partial means, min of mins, ...)."""
    combine = {"min": torch.minimum, "max": torch.maximum, "sum": torch.add}
    merged: dict[str, Tensor] = {}
    for metrics in per_micro_batch:
        for name, value in metrics.items():
            value = value.detach()
            merged[name] = combine[_reduce_kind(name)](merged[name], value) if name in merged else value.clone()
    return merged


def all_reduce_metrics(metrics: Mapping[str, Tensor], process_group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
    """All-reduce merged metrics across ranks: SUM for partial means, MIN / MAX for ``*_min`` / ``*_max``."""
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    out: dict[str, Tensor] = {}
    by_kind: dict[str, list[str]] = {}
    for name in sorted(metrics):  # same order on every rank
        by_kind.setdefault(_reduce_kind(name), []).append(name)
    # One collective per reduce kind (at most three), not one per metric: each is a launch and a host round trip
    # (a step has dozens of metrics), and a step should not pay them by the dozen.
    for kind, names in sorted(by_kind.items()):
        values = [metrics[name].detach() for name in names]
        packed = torch.cat([v.reshape(-1).to(torch.float64) for v in values])
        all_reduce_(packed, op=ops[kind], group=process_group)
        for name, value, part in zip(names, values, packed.split([v.numel() for v in values])):
            out[name] = part.reshape(value.shape).to(value.dtype)
    return out
