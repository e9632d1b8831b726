"""mpo.models.lean_local: the local spec's linears skip megatron's parallel plumbing at tensor-parallel size 1, its
experts run as grouped matmuls on the CPU, and both compute exactly what megatron's own classes compute.

The reference is the same model built from megatron's unmodified local spec (its ColumnParallelLinear /
RowParallelLinear with their custom autograd Functions, its SequentialMLP looping over expert modules), loaded with
the same weights: logits and every gradient must be bit-identical. Pure data parallelism first (one rank, DP2), then
bf16, DeepSeek-V3's block spec (MLA, a dense first layer, a shared expert), then TP2, where the lean linears must hand
every call to megatron's forward (the all-reduces) and the experts their loop.
"""

from __future__ import annotations

import pytest
import torch

from helpers.same_model import assert_bit_identical
from helpers.spawn import spawn_ranks


def _model_pair(preset_name: str, tensor_parallel: int, dtype: str):
    """(mpo's model, the same model from megatron's own classes with mpo's weights) on this rank."""
    import mpo.models.lean_local as lean_local
    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = preset(preset_name)
    ctx = initialize_parallel(ParallelConfig(tensor_parallel=tensor_parallel), num_experts=cfg.num_experts)
    precision = PrecisionConfig(dtype=dtype, fp32_lm_head=False)
    model = build_model(cfg, ctx.parallel, ctx.device, precision, seed=3)
    swap = lean_local.use_lean_modules
    lean_local.use_lean_modules = lambda spec: spec  # the builder's spec as megatron makes it
    try:
        reference = build_model(cfg, ctx.parallel, ctx.device, precision, seed=4)
    finally:
        lean_local.use_lean_modules = swap
    reference.load_state_dict(model.state_dict(), strict=True)
    return cfg, model, reference


def _bit_identical(preset_name: str, tensor_parallel: int, dtype: str = "fp32") -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    from mpo.models.builder import unwrap
    from mpo.models.lean_local import GroupedSequentialMLP, LeanColumnParallelLinear, LeanRowParallelLinear

    lean_types = (LeanColumnParallelLinear, LeanRowParallelLinear, GroupedSequentialMLP)
    cfg, model, reference = _model_pair(preset_name, tensor_parallel, dtype)
    decoder = unwrap(model).decoder
    linears = [m for name, m in decoder.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
               and not name.endswith("down_proj")]  # MLA's down projections stay megatron's (see the module)
    assert linears and all(isinstance(m, (LeanColumnParallelLinear, LeanRowParallelLinear)) for m in linears)
    experts = [m for m in decoder.modules() if isinstance(m, SequentialMLP)]
    assert experts and all(isinstance(m, GroupedSequentialMLP) for m in experts)
    assert {m.matmul_only for m in linears} == {tensor_parallel == 1}
    assert {m.grouped for m in experts} == {tensor_parallel == 1}
    assert not any(isinstance(m, lean_types) for m in reference.modules())
    assert list(model.state_dict()) == list(reference.state_dict())
    assert sorted(model.sharded_state_dict()) == sorted(reference.sharded_state_dict())

    ids = torch.randint(0, cfg.vocab_size, (6, 12), generator=torch.Generator().manual_seed(0))
    grads = assert_bit_identical(model, reference, ids)
    assert sum(".experts." in name for name in grads) >= 2 * cfg.num_experts


@pytest.mark.parametrize("ranks,tensor_parallel,preset_name,dtype", [
    (1, 1, "tiny", "fp32"), (2, 1, "tiny", "fp32"), (1, 1, "tiny", "bf16"), (1, 1, "tiny-dsv3", "fp32"),
    (2, 2, "tiny", "fp32")], ids=["one-rank", "dp2", "bf16", "dsv3", "tp2"])
def test_lean_modules_are_bit_identical_to_megatrons(ranks, tensor_parallel, preset_name, dtype):
    spawn_ranks(ranks, _bit_identical, preset_name, tensor_parallel, dtype)


def test_spec_swap_leaves_megatrons_spec_untouched():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    from mpo.models.lean_local import (GroupedSequentialMLP, LeanColumnParallelLinear, LeanRowParallelLinear,
                                       use_lean_modules)

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm")
    lean = use_lean_modules(spec)
    attention, lean_attention = spec.submodules.self_attention.submodules, lean.submodules.self_attention.submodules
    assert (attention.linear_qkv, attention.linear_proj) == (ColumnParallelLinear, RowParallelLinear)
    assert (lean_attention.linear_qkv, lean_attention.linear_proj) == (LeanColumnParallelLinear, LeanRowParallelLinear)
    assert spec.submodules.mlp.keywords["submodules"].experts.func is SequentialMLP
    experts = lean.submodules.mlp.keywords["submodules"].experts
    assert experts.func is GroupedSequentialMLP
    mlp = experts.keywords["submodules"]
    assert (mlp.linear_fc1, mlp.linear_fc2) == (LeanColumnParallelLinear, LeanRowParallelLinear)
