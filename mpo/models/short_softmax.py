"""Causal attention softmax over fewer than 16 positions on the CPU, computed at 16.

torch's CPU softmax over the last dimension vectorises 16 floats at a time (AVX-512) and falls back to a scalar loop,
about 10x slower, when that dimension is shorter (docs/measurements.md). megatron-core's local spec (the CPU path)
runs that softmax (FusedScaleMaskSoftmax's torch fallback) in every attention layer, forward and backward: on the CPU
demo (13 positions) it was a fifth of a forward. So for a causal mask megatron builds itself (no mask given, square
scores), the scores are zero-padded to 16 x 16 and the same softmax runs on them: the causal mask hides every padded
column from every real row (column j > row i), so each real row's probabilities are those of the unpadded scores (to
float rounding: the vectorised sum adds in another order, <= 2.4e-7 on the demo's logits), and the padded rows are
cut away. Anything else (an explicit mask, packed sequences, a sliding window, a learnable softmax offset, 16
positions or more, a GPU) goes to megatron's softmax unchanged. A tiny-model artefact, fixed only because the CPU
demo and the test suite live at these lengths; it never applies at a real model's sequence lengths.
"""

from __future__ import annotations

import torch

VECTOR_WIDTH = 16  # fp32 lanes of an AVX-512 register: torch's CPU softmax vectorises over this many


class ShortCausalSoftmax(torch.nn.Module):
    """Wraps a FusedScaleMaskSoftmax; see the module docstring."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, scores: torch.Tensor, mask: torch.Tensor | None, softmax_offset=None) -> torch.Tensor:
        from megatron.core.transformer.enums import AttnMaskType

        inner = self.inner
        sq, sk = scores.shape[-2:]
        if (scores.device.type != "cpu" or sk >= VECTOR_WIDTH or sq != sk or mask is not None
                or softmax_offset is not None or inner.window_size is not None
                or inner.attn_mask_type != AttnMaskType.causal):
            return inner(scores, mask, softmax_offset)
        pad = VECTOR_WIDTH - sk
        return inner(torch.nn.functional.pad(scores, (0, pad, 0, pad)), None)[..., :sq, :sk]


def pad_short_causal_softmax(model: torch.nn.Module) -> int:
    """Wrap the softmax of every megatron DotProductAttention in `model` (call on a CPU model); returns how many."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    wrapped = 0
    for module in model.modules():
        if isinstance(module, DotProductAttention) and not isinstance(module.scale_mask_softmax, ShortCausalSoftmax):
            module.scale_mask_softmax = ShortCausalSoftmax(module.scale_mask_softmax)
            wrapped += 1
    return wrapped
