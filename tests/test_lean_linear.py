"""mpo.models.lean_linear: the local spec's linears skip megatron's parallel plumbing at tensor-parallel size 1 and
compute exactly what megatron's own classes compute.

The reference is the same model built from megatron's unmodified local spec (its ColumnParallelLinear /
RowParallelLinear, their custom autograd Functions), loaded with the same weights: logits and every gradient must be
bit-identical. Pure data parallelism first (one rank, DP2), then DeepSeek-V3's block spec (MLA, a dense first layer,
a shared expert), then TP2, where the lean classes must hand every call to megatron's forward (the all-reduces).
"""

from __future__ import annotations

import pytest
import torch

from helpers.spawn import spawn_ranks


def _model_pair(preset_name: str, tensor_parallel: int):
    """(mpo's model, the same model from megatron's own linear classes with mpo's weights) on this rank."""
    import mpo.models.lean_linear as lean_linear
    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel

    ctx = initialize_parallel(ParallelConfig(tensor_parallel=tensor_parallel))
    cfg = preset(preset_name)
    model = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype="fp32"), seed=3)
    swap = lean_linear.use_lean_linears
    lean_linear.use_lean_linears = lambda spec: spec  # the builder's spec as megatron makes it
    try:
        reference = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype="fp32"), seed=4)
    finally:
        lean_linear.use_lean_linears = swap
    reference.load_state_dict(model.state_dict(), strict=True)
    return cfg, model, reference


def _bit_identical(preset_name: str, tensor_parallel: int) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from mpo.models.lean_linear import LeanColumnParallelLinear, LeanRowParallelLinear

    cfg, model, reference = _model_pair(preset_name, tensor_parallel)
    lean = [m for name, m in model.decoder.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            and not name.endswith("down_proj")]  # MLA's down projections stay megatron's (see the module)
    assert lean and all(isinstance(m, (LeanColumnParallelLinear, LeanRowParallelLinear)) for m in lean)
    assert {m.matmul_only for m in lean} == {tensor_parallel == 1}
    assert not any(isinstance(m, (LeanColumnParallelLinear, LeanRowParallelLinear)) for m in reference.modules())
    assert list(model.state_dict()) == list(reference.state_dict())
    assert sorted(model.sharded_state_dict()) == sorted(reference.sharded_state_dict())

    ids = torch.randint(0, cfg.vocab_size, (6, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    outputs = []
    for net in (model, reference):
        logits = net(ids, positions, None)
        # A loss that reaches every weight: log-probs of the ids under the (vocab-parallel) logits, as training does
        logits.float().logsumexp(-1).sum().backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}))
    (logits, grads), (ref_logits, ref_grads) = outputs
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and len(grads) > 20
    assert all(torch.equal(grads[name], ref_grads[name]) for name in grads), \
        [name for name in grads if not torch.equal(grads[name], ref_grads[name])]


@pytest.mark.parametrize("ranks,tensor_parallel,preset_name", [(1, 1, "tiny"), (2, 1, "tiny"), (1, 1, "tiny-dsv3"),
                                                              (2, 2, "tiny")], ids=["one-rank", "dp2", "dsv3", "tp2"])
def test_lean_linears_are_bit_identical_to_megatrons(ranks, tensor_parallel, preset_name):
    spawn_ranks(ranks, _bit_identical, preset_name, tensor_parallel)


def test_spec_swap_leaves_megatrons_spec_untouched():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from mpo.models.lean_linear import LeanColumnParallelLinear, LeanRowParallelLinear, use_lean_linears

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm")
    lean = use_lean_linears(spec)
    attention, lean_attention = spec.submodules.self_attention.submodules, lean.submodules.self_attention.submodules
    assert (attention.linear_qkv, attention.linear_proj) == (ColumnParallelLinear, RowParallelLinear)
    assert (lean_attention.linear_qkv, lean_attention.linear_proj) == (LeanColumnParallelLinear, LeanRowParallelLinear)
    experts = lean.submodules.mlp.keywords["submodules"].experts.keywords["submodules"]
    assert (experts.linear_fc1, experts.linear_fc2) == (LeanColumnParallelLinear, LeanRowParallelLinear)
