"""Multi-latent attention on megatron-core's local (CPU) layer spec.

megatron-core 0.19.2's MLA passes `k_channels` (q/k head width, nope + rope) and `v_channels` (v head width) to its
core attention. Transformer Engine's DotProductAttention takes them; the local `DotProductAttention` does not
(TypeError at construction). Its math already works per head for any q/k and v widths (baddbmm over the last axis,
bmm with v); only the output reshape assumes width kv_channels. This subclass accepts both arguments and sizes the
output by v_channels. MLA always passes an explicit softmax_scale, so kv_channels' default scale is never used.

`tests/test_convert_dsv3.py::test_local_dot_product_attention_still_rejects_mla_channels` fails once megatron's own
class accepts them: then delete this module.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


class LocalMLADotProductAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels

    def forward(self, query, key, value, *args, **kwargs):
        # MLA's value is a split of the kv up-projection: make it contiguous for the local class's .view().
        return super().forward(query, key.contiguous(), value.contiguous(), *args, **kwargs)


def use_local_mla_core_attention(block_spec) -> None:
    """Swap the local spec's core attention in every MLA layer spec of a block spec (in place)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for spec in block_spec.layer_specs:
        attention = spec.submodules.self_attention
        if attention.module is MLASelfAttention or (isinstance(attention.module, type)
                                                    and issubclass(attention.module, MLASelfAttention)):
            if attention.submodules.core_attention is DotProductAttention:
                attention.submodules.core_attention = LocalMLADotProductAttention
