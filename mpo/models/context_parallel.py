"""Context parallelism (CP) for the local layer spec: the same split and the same attention result as megatron-core's
CP with Transformer Engine, computed by all-gathering keys and values over the CP group.

megatron-core splits a row of S tokens into 2 x CP chunks and gives CP rank r chunks r and 2 CP - 1 - r (load
balance under the causal mask: every rank gets one early and one late chunk). Its rotary embedding already follows
that split (`get_pos_emb_on_this_cp_rank`); only its attention needs Transformer Engine's ring attention. Here
`ContextParallelAttention` replaces the local spec's core attention: each rank all-gathers K and V over the CP group
(the backward reduce-scatters their gradients), and masks by the global positions of its query chunks and of every
key: causal, and, for packed rows, the whole row's block-diagonal mask (`attention_mask` [b, 1, S, S], True = may not
attend), indexed at those positions. Memory per rank is K and V of the whole row (not the scores of it): this is the
CPU proof and the no-TE fallback, where TE's ring attention would pass K/V blocks around instead.

`split_for_context_parallel` / `gather_from_context_parallel` / `gather_with_grad` move per-token tensors between a
whole row and this rank's two chunks (this module imports no megatron: mpo.models.forward uses it on every pass);
the attention is mpo.models.cp_attention.
"""

from __future__ import annotations

import torch
from torch import Tensor


def row_multiple() -> int:
    """Row lengths a forward needs to be a multiple of under context parallelism: 2 x CP chunks, each split over TP
    (sequence parallelism); 1 without CP (or before megatron's parallel state exists)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return 1
    return 2 * ps.get_context_parallel_world_size() * ps.get_tensor_model_parallel_world_size()


def padded_width(length: int) -> int:
    """`length` rounded up to row_multiple(): where a caller pads a one-off batch (probes) with trailing tokens."""
    multiple = row_multiple()
    return -(-length // multiple) * multiple


def chunk_positions(seq_len: int, rank: int, size: int, device: torch.device | str = "cpu") -> Tensor:
    """Global positions of CP rank `rank`'s tokens: chunks `rank` and 2 size - 1 - rank of 2 size equal chunks."""
    if seq_len % (2 * size):
        raise ValueError(f"context parallelism {size}: the row length {seq_len} must be a multiple of {2 * size}")
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


def split_for_context_parallel(x: Tensor, rank: int, size: int, dim: int = 1) -> Tensor:
    """This CP rank's tokens of a whole-row tensor (tokens along `dim`)."""
    if size == 1:
        return x
    return x.index_select(dim, chunk_positions(x.shape[dim], rank, size, x.device))


def gather_from_context_parallel(x: Tensor, group, dim: int = 1) -> Tensor:
    """The whole row from every CP rank's tokens (along `dim`), in global order. Not differentiable (outputs)."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    seq = x.shape[dim] * size
    positions = torch.cat([chunk_positions(seq, r, size, x.device) for r in range(size)])
    ranks_order = torch.cat(parts, dim=dim)  # rank 0's chunks, rank 1's, ...: put each token at its position
    return torch.empty_like(ranks_order).index_copy_(dim, positions, ranks_order)


class _GatherFromContextParallel(torch.autograd.Function):
    """gather_from_context_parallel with a gradient: every CP rank computes the same loss of the whole row, so the
    gradient of this rank's tokens is the whole row's gradient at its positions (nothing to reduce)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int) -> Tensor:
        size = torch.distributed.get_world_size(group)
        ctx.dim, ctx.positions = dim, chunk_positions(x.shape[dim] * size, torch.distributed.get_rank(group), size,
                                                      x.device)
        return gather_from_context_parallel(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.index_select(ctx.dim, ctx.positions), None, None


def gather_with_grad(x: Tensor, group, dim: int = 1) -> Tensor:
    """The whole row from every CP rank's tokens, differentiable (see _GatherFromContextParallel)."""
    if torch.distributed.get_world_size(group) == 1:
        return x
    return _GatherFromContextParallel.apply(x, group, dim)
