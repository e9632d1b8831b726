"""ContextParallelAttention: the local spec's core attention under context parallelism (see
mpo.models.context_parallel for the split and why the result equals CP1's). It gathers K/V over the CP group, builds
the causal (or packed) mask at the chunks' global positions and calls the same kernel as the local spec's fused
attention (mpo.models.sdpa_attention.attend: torch SDPA, no s x s scores tensor per head on its fused kernels)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mpo.models.context_parallel import chunk_positions
from mpo.models.sdpa_attention import SdpaAttention, attend


class ContextParallelAttention(SdpaAttention):
    """The local spec's attention with its sequence split over the CP group (module docstring)."""

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
        return attend(query, key, value, scale=self.sdpa_scale, blocked=blocked)


def use_context_parallel_attention(spec: Any) -> int:
    """Swap the local core attention (megatron's DotProductAttention or mpo's SdpaAttention) for
    ContextParallelAttention in a layer or block spec; returns how many."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    swapped = 0
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention
        if attention.submodules.core_attention in (DotProductAttention, SdpaAttention):
            attention.submodules.core_attention = ContextParallelAttention
            swapped += 1
    return swapped
