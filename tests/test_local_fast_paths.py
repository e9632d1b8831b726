"""The local spec's fast paths (issue #43), proven on the CPU: torch SDPA attention (mpo.models.sdpa_attention)
computes what megatron's local DotProductAttention computes (causal, packed block-diagonal from a mask or from THD
cu_seqlens, GQA; fp32 to 1e-6, bf16 within rounding), a whole GPTModel on it equals one from megatron's unmodified
local spec, and the device profile picks the attention and the expert computation with one line each.

What needs a GPU is stood in for and named where it is: a CUDA machine is `torch.cuda.is_available` patched to True
with a compute capability handed in (the selection only; no kernel runs); the grouped experts' CUDA kernel is stood
in for by torch's `meta` device, whose `_grouped_mm` kernel runs the CUDA kernel's input checks (bf16, 16-byte row
strides, int32 offsets) without computing. The kernels' numbers on a GPU are the offline GPU tier's job.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from helpers.spawn import spawn_ranks

# (name, dtype, query groups, batch, sequence lengths of a packed row or None for plain causal rows, how packed)
CASES = [
    ("causal", torch.float32, 4, 2, None, None),
    ("gqa", torch.float32, 2, 2, None, None),
    ("packed-mask", torch.float32, 2, 1, (7, 9, 8), "mask"),
    ("packed-thd", torch.float32, 4, 1, (11, 13), "thd"),
    ("causal-bf16", torch.bfloat16, 2, 2, None, None),
    ("packed-bf16", torch.bfloat16, 2, 1, (7, 9, 8), "mask"),
]
SEQ = 24


def _attention_pair(dtype: torch.dtype, groups: int):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mpo.models.sdpa_attention import SdpaAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                               kv_channels=16, attention_dropout=0.0, use_cpu_initialization=True,
                               bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return tuple(cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
                 for cls in (DotProductAttention, SdpaAttention))


def _run(module, q, k, v, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def _attention_cases() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    from mpo.models.packed import PackedLayout
    from mpo.parallel import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    gen = torch.Generator().manual_seed(0)
    for name, dtype, groups, batch, lens, packing in CASES:
        megatron, sdpa = _attention_pair(dtype, groups)
        q = torch.randn(SEQ, batch, 4, 16, generator=gen)
        k, v = (torch.randn(SEQ, batch, groups, 16, generator=gen) for _ in range(2))
        mask = PackedLayout.build(list(lens), SEQ, thd=False).attention_mask("cpu") if lens else None
        ours = {"attention_mask": mask}
        if packing == "thd":  # megatron's local attention refuses THD: its reference is the same rows as a mask
            cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            ours = {"attention_mask": None, "packed_seq_params": PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))}
        want = _run(megatron, *(t.to(dtype) for t in (q, k, v)), attention_mask=mask)
        got = _run(sdpa, *(t.to(dtype) for t in (q, k, v)), **ours)
        if dtype == torch.float32:
            for what, a, b in zip(("output", "dq", "dk", "dv"), got, want):
                assert (a - b).abs().max() <= 1e-6, (name, what, (a - b).abs().max())
        else:  # within rounding: no further from the fp32 computation than megatron's own bf16 result is
            megatron32, _ = _attention_pair(torch.float32, groups)
            exact = _run(megatron32, q, k, v, attention_mask=mask)
            for what, a, b, e in zip(("output", "dq", "dk", "dv"), got, want, exact):
                ours_err, theirs_err = (a - e).abs().max(), (b - e).abs().max()
                assert ours_err <= 2 * theirs_err + 2 ** -8 * e.abs().max(), (name, what, ours_err, theirs_err)
        print(f"fast_path attention {name}: ok")


def test_fast_path_sdpa_attention_matches_megatrons_local_attention(capfd):
    spawn_ranks(1, _attention_cases)
    out = capfd.readouterr().out
    assert all(f"fast_path attention {case[0]}: ok" in out for case in CASES), out


def _model_pair(attention: str, precision):
    import mpo.models.lean_local as lean_local
    from mpo.models.builder import build_model
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = preset("tiny-2layer")
    ctx = initialize_parallel(ParallelConfig(), num_experts=cfg.num_experts)
    device = dataclasses.replace(ctx.device, attention=attention)
    model = build_model(cfg, ctx.parallel, device, precision, seed=3)
    swap = lean_local.use_lean_modules
    lean_local.use_lean_modules = lambda spec: spec  # megatron's unmodified local spec
    try:
        reference = build_model(cfg, ctx.parallel, dataclasses.replace(ctx.device, attention="local"), precision,
                                seed=4)
    finally:
        lean_local.use_lean_modules = swap
    reference.load_state_dict(model.state_dict(), strict=True)
    return cfg, model, reference


def _whole_model() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mpo.models.builder import PrecisionConfig
    from mpo.models.packed import PackedLayout
    from mpo.models.sdpa_attention import SdpaAttention

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    cfg, model, reference = _model_pair("sdpa", PrecisionConfig(dtype="fp32", fp32_lm_head=True))
    assert sum(isinstance(m, SdpaAttention) for m in model.modules()) == cfg.num_layers
    assert not any(isinstance(m, SdpaAttention) for m in reference.modules())
    assert sum(type(m) is DotProductAttention for m in reference.modules()) == cfg.num_layers
    assert list(model.state_dict()) == list(reference.state_dict())
    assert sorted(model.sharded_state_dict()) == sorted(reference.sharded_state_dict())
    gen = torch.Generator().manual_seed(0)
    layout = PackedLayout.build([9, 7, 8], 24, thd=False)
    for name, ids, positions, mask in [
            ("causal", torch.randint(0, cfg.vocab_size, (3, 20), generator=gen), None, None),
            ("packed", torch.randint(0, cfg.vocab_size, (1, 24), generator=gen), layout.position_ids(),
             layout.attention_mask("cpu"))]:
        positions = torch.arange(ids.shape[1]).expand_as(ids) if positions is None else positions
        results = []
        for net in (model, reference):
            net.zero_grad(set_to_none=True)
            logits = net(ids, positions, mask)
            logits.float().logsumexp(-1).sum().backward()
            results.append((logits.detach(), {n: p.grad.clone() for n, p in net.named_parameters()
                                              if p.grad is not None}))
        (logits, grads), (ref_logits, ref_grads) = results
        assert (logits - ref_logits).abs().max() <= 1e-5, (name, (logits - ref_logits).abs().max())
        assert grads.keys() == ref_grads.keys() and len(grads) > 10
        for key, grad in grads.items():
            assert (grad - ref_grads[key]).abs().max() <= 1e-5 * max(1.0, ref_grads[key].abs().max().item()), key
        print(f"fast_path model {name}: ok")


def test_fast_path_whole_model_on_sdpa_equals_megatrons_local_spec(capfd):
    """A tiny GPTModel (GQA, qk-norm, MoE) built with SDPA attention and the lean modules against the same weights in
    megatron's unmodified local spec: logits and every gradient, plain causal rows and a packed row; the two
    selection line (attention; experts) is logged once per choice."""
    spawn_ranks(1, _whole_model)
    captured = capfd.readouterr()
    assert "fast_path model causal: ok" in captured.out and "fast_path model packed: ok" in captured.out
    logs = captured.err
    assert logs.count("attention: torch SDPA (flash / memory-efficient kernels); experts: torch grouped GEMM (cpu "
                      "float32)") == 1, logs
    assert logs.count("attention: megatron local (unfused); experts: torch grouped GEMM (cpu float32)") == 1, logs
    # ^ the reference's build


@pytest.fixture
def fake_gpu(monkeypatch):
    """A machine that says it has CUDA (compute capability 9.0) and no Transformer Engine; nothing runs on it."""
    from mpo.parallel import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "_cuda_capability", lambda index: (9, 0))
    monkeypatch.setattr(device, "transformer_engine_problem", lambda: "transformer_engine is not importable (...)")
    for name in ("MPO_LAYER_SPEC", "MPO_ATTENTION"):
        monkeypatch.delenv(name, raising=False)
    return device


def test_fast_path_selection_by_device(fake_gpu, monkeypatch):
    device = fake_gpu
    gpu = device.detect_device(0)
    assert (gpu.layer_spec, gpu.attention) == ("local", "sdpa")
    assert gpu.fast_path_lines(torch.bfloat16) == ("attention: torch SDPA (flash / memory-efficient kernels)",
                                                   "experts: torch grouped GEMM (cuda bfloat16)")
    assert gpu.fast_path_lines(torch.float32)[1] == \
        "experts: megatron per-expert loop (no torch grouped GEMM for float32 on cuda:0)"
    cpu = device.detect_device(0, force_cpu=True)
    assert cpu.attention == "local"
    assert cpu.fast_path_lines(torch.float32) == ("attention: megatron local (unfused)",
                                                  "experts: torch grouped GEMM (cpu float32)")
    # a GPU older than torch's grouped GEMM (compute capability 8.0, torch 2.14) keeps the per-expert loop
    cuda = torch.device("cuda", 0)
    assert device.grouped_mm_dtypes(cuda, capability=(7, 5)) == frozenset()
    assert device.grouped_mm_dtypes(cuda, capability=(8, 0)) == {torch.bfloat16}
    assert device.grouped_mm_dtypes(torch.device("meta")) == frozenset()
    # the named switch, its override and its errors
    monkeypatch.setenv("MPO_ATTENTION", "local")
    assert device.detect_device(0).attention == "local"
    monkeypatch.setenv("MPO_ATTENTION", "sdpa")
    assert device.detect_device(0, force_cpu=True).attention == "sdpa"
    monkeypatch.setenv("MPO_ATTENTION", "flash")
    with pytest.raises(ValueError, match="MPO_ATTENTION='flash'; valid values: sdpa, local"):
        device.detect_device(0)
    monkeypatch.setattr(device, "transformer_engine_problem", lambda: None)  # TE importable: TE's attention
    monkeypatch.delenv("MPO_ATTENTION")
    te = device.detect_device(0)
    assert (te.layer_spec, te.attention) == ("te", "te")
    monkeypatch.setenv("MPO_ATTENTION", "sdpa")
    with pytest.raises(ValueError, match="MPO_ATTENTION=sdpa applies to the local layer spec"):
        device.detect_device(0)


def test_fast_path_sdpa_refuses_what_it_does_not_compute():
    from types import SimpleNamespace

    from mpo.models.sdpa_attention import unsupported

    config = SimpleNamespace(softmax_type="vanilla", fp16=False, attention_softmax_in_fp32=True)
    assert unsupported(config, 0.0, None) is None
    assert "dropout" in unsupported(config, 0.1, None)
    assert "sliding-window" in unsupported(config, 0.0, (8, 0))
    assert "softmax_type" in unsupported(SimpleNamespace(**{**vars(config), "softmax_type": "learnable"}), 0.0, None)


def _grouped_on_stand_in_device() -> None:
    import mpo.models.lean_local as lean_local
    from mpo.models.builder import PrecisionConfig, build_model, unwrap
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = preset("tiny-2layer")
    ctx = initialize_parallel(ParallelConfig(), num_experts=cfg.num_experts)
    model = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype="bf16", fp32_lm_head=False))
    experts = next(m for m in unwrap(model).modules() if isinstance(m, lean_local.GroupedSequentialMLP))
    assert experts.grouped
    experts.to("meta")
    calls = []
    grouped_mm = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(args[0].device.type)
        return grouped_mm(*args, **kwargs)

    torch._grouped_mm = counted
    stand_in = {"meta": frozenset({torch.bfloat16})}
    lean_local.grouped_mm_dtypes = lambda dev: stand_in.get(dev.type, frozenset())  # meta stands in for CUDA
    tokens = torch.tensor([5, 0, 3, 8, 1, 0, 2, 6])
    hidden = torch.empty(int(tokens.sum()), cfg.hidden_size, dtype=torch.bfloat16, device="meta", requires_grad=True)
    probs = torch.empty(int(tokens.sum()), dtype=torch.float32, device="meta")
    out, bias = experts(hidden, tokens, probs)
    # a dense gradient, as the MoE layer's unpermutation hands back (`out.sum()` would hand an expanded, stride-0
    # one, which the CUDA kernel's stride checks refuse)
    out.backward(torch.empty_like(out))
    assert (out.shape, out.dtype, bias, hidden.grad.shape) == ((25, cfg.hidden_size), torch.bfloat16, None,
                                                               hidden.shape)
    assert len(calls) >= 2 and set(calls) == {"meta"}, calls
    stand_in.clear()  # a device torch's grouped GEMM does not take (an old GPU): megatron's loop, no grouped call
    calls.clear()
    out, _ = experts(hidden, tokens, probs)
    assert calls == [] and out.shape == (25, cfg.hidden_size)
    print("fast_path experts: ok")


def test_fast_path_grouped_experts_on_a_stand_in_cuda_device(capfd):
    """GroupedSequentialMLP in bf16 on the `meta` device declared grouped-GEMM capable (standing in for CUDA >= 8.0):
    forward and backward go through torch._grouped_mm, whose meta kernel applies the CUDA kernel's input checks;
    declared incapable, the same module runs megatron's per-expert loop."""
    spawn_ranks(1, _grouped_on_stand_in_device)
    assert "fast_path experts: ok" in capfd.readouterr().out
