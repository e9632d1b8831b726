"""mpo.models.short_softmax: megatron's causal attention softmax below 16 positions, computed zero-padded to 16 on
the CPU. Reference: megatron-core's own FusedScaleMaskSoftmax (its torch fallback, unwrapped) on the same scores,
values and gradients; cases the padding does not cover reach megatron's softmax untouched (bit for bit). Each test
runs in a spawned rank (megatron's causal mask needs mpo's CPU shims, which initialize_parallel applies)."""

from __future__ import annotations

import torch

from helpers.spawn import spawn_ranks


def _megatron_softmax(mask_type: str = "causal"):
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    return FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=False, attn_mask_type=getattr(AttnMaskType,
                                 mask_type), scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
                                 softmax_in_fp32=True, scale=0.25)


def _values_and_gradients() -> None:
    from mpo.models.short_softmax import ShortCausalSoftmax
    from mpo.parallel import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    inner = _megatron_softmax()
    for positions in (1, 5, 13, 15):
        generator = torch.Generator().manual_seed(positions)
        scores = torch.randn(3, 4, positions, positions, dtype=torch.float64, generator=generator)
        weights = torch.randn(scores.shape, dtype=torch.float64, generator=generator)
        results = []
        for softmax in (inner, ShortCausalSoftmax(inner)):
            x = scores.clone().requires_grad_(True)
            probs = softmax(x, None)
            (probs * weights).sum().backward()
            results.append((probs.detach(), x.grad))
        (want, want_grad), (got, got_grad) = results
        assert got.shape == want.shape == scores.shape, positions
        assert torch.allclose(got, want, atol=1e-12, rtol=0), (positions, (got - want).abs().max())
        assert torch.allclose(got_grad, want_grad, atol=1e-12, rtol=0), (positions, (got_grad - want_grad).abs().max())
        assert torch.triu(got[0, 0], diagonal=1).abs().max() == 0  # still causal


def test_padded_softmax_equals_megatrons_values_and_gradients():
    spawn_ranks(1, _values_and_gradients)


def _passed_through() -> None:
    from mpo.models.short_softmax import ShortCausalSoftmax
    from mpo.parallel import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    inner = _megatron_softmax()
    wrapped = ShortCausalSoftmax(inner)
    generator = torch.Generator().manual_seed(3)
    long = torch.randn(2, 4, 16, 16, generator=generator)
    decode = torch.randn(2, 4, 1, 9, generator=generator)  # one query over a KV cache
    masked = torch.randn(2, 4, 6, 6, generator=generator)
    mask = torch.rand(2, 1, 6, 6, generator=generator) > 0.5
    for scores, given in ((long, None), (decode, None), (masked, mask)):
        assert torch.equal(wrapped(scores, given), inner(scores, given))
    padding = _megatron_softmax("padding")
    assert torch.equal(ShortCausalSoftmax(padding)(masked, mask), padding(masked, mask))


def test_cases_the_padding_does_not_cover_reach_megatrons_softmax_unchanged():
    spawn_ranks(1, _passed_through)


def _wrapped_layers() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.models.short_softmax import ShortCausalSoftmax, pad_short_causal_softmax
    from mpo.parallel import ParallelConfig, initialize_parallel

    ctx = initialize_parallel(ParallelConfig())
    model = build_model(preset("tiny"), ctx.parallel, ctx.device, PrecisionConfig(dtype="fp32"), seed=1)
    attention = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    assert len(attention) == preset("tiny").num_layers
    assert all(isinstance(m.scale_mask_softmax, ShortCausalSoftmax) for m in attention)
    assert pad_short_causal_softmax(model) == 0  # already wrapped: not twice
    assert not any("scale_mask_softmax" in key for key in model.state_dict())  # no state of its own


def test_cpu_model_wraps_every_attention_layer_once():
    spawn_ranks(1, _wrapped_layers)
