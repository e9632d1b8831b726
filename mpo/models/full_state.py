"""Assemble full (layout-free) tensors from the shards that TP/PP/EP ranks hold, using megatron's own sharding
metadata (`sharded_state_dict`): every ShardedTensor knows its global shape and offset, so the same code gathers any
layout, with no per-parameter split rules of ours. Keys are megatron's torch_dist keys (layers stacked on a leading
axis, experts on the next), identical at every layout, so two layouts can be compared tensor by tensor.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _params_hold_grads(model: torch.nn.Module) -> Iterator[None]:
    """Temporarily make every parameter's .data its gradient (zeros where there is none)."""
    saved = []
    for param in model.parameters():
        grad = getattr(param, "main_grad", None) if param.grad is None else param.grad
        saved.append((param, param.data))
        param.data = grad.detach().to(param.dtype) if grad is not None else torch.zeros_like(param.data)
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data


def main_shards(model: torch.nn.Module) -> list:
    """This rank's main-replica ShardedTensors of `model` (megatron's sharded state dict, factories applied)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    shards = []
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor) and is_main_replica(item.replica_id):
            if item.flattened_range is not None:
                raise NotImplementedError(f"{item.key}: flattened (distributed-optimizer) shards are not supported")
            shards.append(item)
    return shards


def gather_full_state(model: torch.nn.Module, *, grads: bool = False, dst: int = 0,
                      group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor] | None:
    """Full tensors of the model (or of its gradients, with grads=True) on rank `dst`; None on other ranks.

    Collective: every rank of `group` (default: the world) must call it. Meant for checks and small models: it moves
    every shard through one rank with all_gather_object.
    """
    with _params_hold_grads(model) if grads else contextlib.nullcontext():
        shards = [(item.key, tuple(item.global_shape), tuple(item.global_offset),
                   item.data.detach().to("cpu", copy=True)) for item in main_shards(model)]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, shards, group=group)
        if dist.get_rank(group) != dst:
            return None
        shards = [shard for rank_shards in gathered for shard in rank_shards]
    full: dict[str, torch.Tensor] = {}
    for key, global_shape, offset, data in shards:
        target = full.get(key)
        if target is None:
            target = full[key] = torch.zeros(global_shape, dtype=data.dtype)
        # Leading offsets index prepended axes (layer, expert) that the local tensor lacks.
        prepend = len(global_shape) - data.dim()
        index = tuple(offset[:prepend]) + tuple(slice(o, o + n) for o, n in zip(offset[prepend:], data.shape))
        target[index] = data
    return full

