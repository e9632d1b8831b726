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

`split_for_context_parallel` / `gather_from_context_parallel` move per-token tensors between a whole row and this
rank's two chunks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


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
    out = torch.empty_like(torch.cat(parts, dim=dim))
    out.index_copy_(dim, positions, torch.cat(parts, dim=dim))
    return out


def _core_attention_base():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class ContextParallelAttention(_core_attention_base()):
    """megatron's local DotProductAttention with its sequence split over the CP group (module docstring)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # DotProductAttention refuses CP > 1 (TE only); everything it sets up is per-token and CP-independent.
        size = config.context_parallel_size
        config.context_parallel_size = 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = size

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("context parallelism on the local spec takes packed rows as an attention mask, no bias")
        group = parallel_state.get_context_parallel_group()
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        # [s_local, b, ng, hn] -> [S, b, ng, hn] in rank order of chunks; backward: reduce-scatter of the gradients
        key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=group)
        value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=group)
        seq = query.shape[0] * size
        q_pos = chunk_positions(seq, rank, size, query.device)
        k_pos = torch.cat([chunk_positions(seq, r, size, query.device) for r in range(size)])
        blocked = k_pos[None, :] > q_pos[:, None]  # [sq, sk]: the future
        if attention_mask is not None:  # the whole row's mask (packed sequences), at these positions
            blocked = blocked | attention_mask[..., q_pos[:, None], k_pos[None, :]]
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
        dtype = torch.float32 if self.config.attention_softmax_in_fp32 else query.dtype
        scores = torch.einsum("qbnh,kbnh->bnqk", query.to(dtype), key.to(dtype)) * self.softmax_scale
        probs = scores.masked_fill(blocked, float("-inf")).softmax(-1).to(value.dtype)
        probs = self.attention_dropout(probs)
        context = torch.einsum("bnqk,kbnh->qbnh", probs, value)
        return context.reshape(context.shape[0], context.shape[1], self.hidden_size_per_partition)


def use_context_parallel_attention(spec: Any) -> int:
    """Swap the local DotProductAttention for ContextParallelAttention in a layer or block spec; returns how many."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    swapped = 0
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention
        if attention.submodules.core_attention is DotProductAttention:
            attention.submodules.core_attention = ContextParallelAttention
            swapped += 1
    return swapped
