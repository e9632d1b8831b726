"""SdpaAttention: the local spec's core attention on `torch.nn.functional.scaled_dot_product_attention`.

megatron-core's local DotProductAttention (the core attention of the local spec: the CPU path and a GPU without
Transformer Engine) materialises the scores and probabilities, [b, heads, s, s] each, and runs an unfused masked
softmax between two batched matmuls: on the GPU that is the s^2 memory peak and several kernels per layer. SDPA
computes the same attention in one call, on CUDA with the flash kernel (plain causal rows, bf16/fp16) or the
memory-efficient one (an explicit mask: packed rows; fp32), neither of which keeps an s x s scores tensor per head;
on the CPU torch picks its own kernels (the math kernel, or its CPU flash kernel).

The semantics are megatron's local DotProductAttention's, which this class subclasses (the same constructor,
scale, state dict and sharded state dict; it has no parameters of its own for the vanilla softmax):
* no mask given and a causal mask type: causal (queries attend to keys at their position or before; with one query,
  as in decoding, no mask, as megatron does);
* a mask given (True = may not attend, megatron's convention; mpo's packed rows pass the block-diagonal causal mask,
  mpo.models.packed): exactly that mask;
* `packed_seq_params` (THD, cu_seqlens; megatron's local class refuses them): the block-diagonal causal mask built
  from `cu_seqlens_q`, so one row holds several sequences that never see each other;
* grouped-query attention: keys and values repeated per query head, as megatron does;
* softmax scale: megatron's (1/sqrt(head dim), or the given one; with query-key layer scaling the net scale);
* attention dropout: 0 only (mpo trains without it); anything else is refused at construction.

`attend` is the one kernel call, shared with mpo.models.cp_attention (context parallelism gathers K/V, builds its
mask at global positions and calls it). `use_sdpa_attention` puts the class into a local layer or block spec;
mpo.parallel.device.DeviceProfile.attention decides where (mpo.models.builder.layer_spec).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

log = logging.getLogger(__name__)


def attend(query: Tensor, key: Tensor, value: Tensor, *, scale: float, causal: bool = False,
           blocked: Tensor | None = None) -> Tensor:
    """Attention over megatron's layout: query [sq, b, np, hn], key/value [sk, b, ng, hn] (ng divides np) ->
    context [sq, b, np * hn]. `blocked` (bool, True = may not attend, broadcastable to [b, np, sq, sk]) or `causal`
    (sq == sk), not both. No s x s scores tensor per head is built here (SDPA's fused kernels where they apply)."""
    repeat = query.shape[2] // key.shape[2]
    if repeat > 1:  # GQA as megatron computes it; explicit, so every SDPA kernel (not only flash) accepts it
        key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
    # [s, b, n, h] -> [b, n, s, h]: SDPA's layout (a permuted view; the kernels need only the last stride to be 1)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=None if blocked is None else ~blocked,
                                             dropout_p=0.0, is_causal=causal, scale=scale)
    sq, b, heads, dim = query.shape
    return context.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


def block_diagonal_causal(cu_seqlens: Tensor, length: int) -> Tensor:
    """[1, 1, S, S] bool, True where a query may not attend: another sequence of the row, or the future. `cu_seqlens`
    is THD's [0, end_1, ..., end_n]; tokens beyond its last entry form one more sequence of their own."""
    ends = cu_seqlens[1:].to(torch.long)
    positions = torch.arange(length, device=cu_seqlens.device)
    seq = torch.bucketize(positions, ends, right=True)  # index of the sequence each token belongs to
    future = torch.ones(length, length, dtype=torch.bool, device=cu_seqlens.device).triu_(1)
    return ((seq[:, None] != seq[None, :]) | future)[None, None]


class SdpaAttention(DotProductAttention):
    """megatron's local DotProductAttention computed by torch SDPA (see the module docstring)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        problem = unsupported(self.config, self.attention_dropout.p, self.scale_mask_softmax.window_size)
        if problem:
            raise ValueError(f"torch SDPA attention: {problem}; set MPO_ATTENTION=local for megatron's attention")
        # megatron divides its scale by the layer number and multiplies the scores back in the softmax (fp32)
        self.sdpa_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("torch SDPA attention takes no attention bias (megatron's local attention neither)")
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q
            if not torch.equal(cu, packed_seq_params.cu_seqlens_kv) or query.shape[1] != 1:
                raise ValueError("torch SDPA attention: packed sequences need one row (b = 1) and the same "
                                 "cu_seqlens for queries and keys")
            return attend(query, key, value, scale=self.sdpa_scale,
                          blocked=block_diagonal_causal(cu, query.shape[0]))
        if attention_mask is not None:
            return attend(query, key, value, scale=self.sdpa_scale, blocked=attention_mask)
        # megatron (forward_torch_softmax): its own causal mask for the causal type with more than one query
        causal = self.attn_mask_type == AttnMaskType.causal and query.shape[0] > 1
        if causal and query.shape[0] != key.shape[0]:
            raise ValueError("torch SDPA attention: a causal mask is for self-attention (as many keys as queries)")
        return attend(query, key, value, scale=self.sdpa_scale, causal=causal)


def unsupported(config: Any, dropout: float, window_size: Any) -> str | None:
    """Why megatron's local attention under `config` is not what SdpaAttention computes, or None."""
    if dropout:
        return f"attention dropout {dropout} (only 0 is implemented)"
    if window_size is not None:
        return "sliding-window attention"
    if config.softmax_type != "vanilla":
        return f"softmax_type={config.softmax_type!r}"
    if config.fp16 and not config.attention_softmax_in_fp32:
        return "an fp16 softmax (SDPA accumulates in fp32)"
    return None


def use_sdpa_attention(spec: Any) -> int:
    """Swap megatron's local DotProductAttention for SdpaAttention in a layer or block spec (in place); returns how
    many layers were swapped (MLA's local core attention, mpo.models.mla_local, is left as it is)."""
    swapped = 0
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = getattr(layer.submodules, "self_attention", None)
        submodules = getattr(attention, "submodules", None)
        if getattr(submodules, "core_attention", None) is DotProductAttention:
            submodules.core_attention = SdpaAttention
            swapped += 1
    return swapped


def local_fast_paths(spec: Any, device: Any, config: Any = None) -> Any:
    """A local layer or block spec with the attention `device` (a DeviceProfile) selects: SdpaAttention where it says
    "sdpa", megatron's otherwise; logs once per process, in one line, which attention and which expert computation
    run."""
    if device.attention == "sdpa":
        use_sdpa_attention(spec)
    # one start-up line for both choices (a user reads the first few lines to see what the run does)
    _log_once("; ".join(device.fast_path_lines(config.params_dtype if config is not None else torch.float32)))
    return spec


@functools.cache
def _log_once(line: str) -> None:
    log.info(line)
