"""mpo.models.builder's MoE token dispatcher: megatron's allgather dispatcher where no token crosses a rank (EP1, TP1,
expert-TP1), alltoall elsewhere. The allgather one must compute exactly what megatron's alltoall dispatcher computes
there: the same model built with alltoall (megatron's own code path, not mpo's) and the same weights gives
bit-identical logits and gradients. Pure data parallelism first (one rank, DP2); EP2 keeps alltoall.
"""

from __future__ import annotations

import pytest
import torch

from helpers.same_model import assert_bit_identical
from helpers.spawn import spawn_ranks


def _same_as_alltoall(layout: dict, dispatcher: str) -> None:
    import mpo.models.builder as builder
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg, precision = preset("tiny"), builder.PrecisionConfig(dtype="fp32")
    ctx = initialize_parallel(ParallelConfig(**layout), num_experts=cfg.num_experts)
    model = builder.build_model(cfg, ctx.parallel, ctx.device, precision, seed=5)
    assert {type(layer.mlp.token_dispatcher).__name__ for layer in model.decoder.layers} == {dispatcher}
    if dispatcher == "MoEAlltoAllTokenDispatcher":
        return
    chosen = builder.transformer_config

    def alltoall(*args, **kwargs):
        config = chosen(*args, **kwargs)
        config.moe_token_dispatcher_type = "alltoall"
        return config

    builder.transformer_config = alltoall
    try:
        reference = builder.build_model(cfg, ctx.parallel, ctx.device, precision, seed=6)
    finally:
        builder.transformer_config = chosen
    assert {type(layer.mlp.token_dispatcher).__name__ for layer in reference.decoder.layers} == {
        "MoEAlltoAllTokenDispatcher"}
    reference.load_state_dict(model.state_dict(), strict=True)
    rank = torch.distributed.get_rank()
    ids = torch.randint(0, cfg.vocab_size, (6, 10), generator=torch.Generator().manual_seed(rank))
    grads = assert_bit_identical(model, reference, ids)
    assert any(".experts." in name for name in grads)


@pytest.mark.parametrize("ranks,layout,dispatcher", [
    (1, {}, "MoEAllGatherTokenDispatcher"), (2, {}, "MoEAllGatherTokenDispatcher"),
    (2, {"expert_parallel": 2}, "MoEAlltoAllTokenDispatcher"),
    (2, {"tensor_parallel": 2}, "MoEAlltoAllTokenDispatcher")], ids=["one-rank", "dp2", "ep2", "tp2"])
def test_dispatcher_choice_computes_what_alltoall_computes(ranks, layout, dispatcher):
    spawn_ranks(ranks, _same_as_alltoall, layout, dispatcher)
