"""The streaming sync's plan (mpo.weight_sync.plan.build_plan), a pure function of the shards' metadata: checked on
metadata laid out the way megatron describes a TP2 x PP2 model (stacked layer axis, row/column splits), against
expectations written out by hand. No processes; milliseconds."""

from __future__ import annotations

import pytest

from mpo.models.hf_mapping import mapping_for
from mpo.models.config import preset
from mpo.weight_sync.plan import ShardMeta, build_plan

CFG = preset("tiny-2layer")  # 2 layers, hidden 64, 8 experts
MAPPING = mapping_for(CFG, spec="local")


def _tp2_pp2_metadata():
    """Ranks 0,1 = stage 0 (layer 0, embedding), ranks 2,3 = stage 1 (layer 1, final norm, output layer); within a
    stage TP rank 0/1 split column tensors on dim 0, row tensors on dim 1, experts by halves (EP-like); replicated
    tensors only on TP rank 0 (the main replica)."""
    shards: list[list[ShardMeta]] = [[] for _ in range(4)]
    for unit in MAPPING.units():
        key, shape = unit.keys[0], unit.global_shape
        stage = unit.index[0] if unit.index else (0 if key.startswith("embedding") else 1)
        ranks = (2 * stage, 2 * stage + 1)
        k = len(unit.index)
        local = tuple(shape[k:])
        if unit.rule.scope == "expert":  # expert e lives on TP rank e // 4 of its stage, whole
            holder = ranks[unit.index[1] // (CFG.num_experts // 2)]
            shards[holder].append(ShardMeta(key, shape, unit.offsets, local))
        elif key.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            half = local[0] // 2
            for t, rank in enumerate(ranks):
                shards[rank].append(ShardMeta(key, shape, unit.index + (t * half, 0), (half, *local[1:])))
        elif key.endswith("linear_proj.weight"):
            half = local[1] // 2
            for t, rank in enumerate(ranks):
                shards[rank].append(ShardMeta(key, shape, unit.index + (0, t * half), (local[0], half)))
        else:
            shards[ranks[0]].append(ShardMeta(key, shape, unit.offsets, local))
    return shards


@pytest.mark.parametrize("bucket_bytes", [1, 20_000, 1 << 30])
def test_plan_pieces_senders_and_buckets(bucket_bytes):
    shards = _tp2_pp2_metadata()
    units, buckets = build_plan(MAPPING, shards, [0, 0, 1, 1], bucket_bytes, dtype_bytes=4)
    assert len(units) == len(list(MAPPING.units()))
    for pu in units:
        stage = pu.unit.index[0] if pu.unit.index else (0 if pu.key.startswith("embedding") else 1)
        assert pu.sender == 2 * stage  # the stage's lowest rank
        elements = 0
        for piece in pu.pieces:
            size = 1
            for s in piece.dst:
                size *= s.stop - s.start
            elements += size
        assert elements == __import__("math").prod(pu.shape)  # pieces tile the unit exactly
    proj = next(pu for pu in units if pu.key.endswith("linear_proj.weight") and pu.unit.index == (1,))
    assert [(p.holder, p.dst) for p in proj.pieces] == [(2, (slice(0, 64), slice(0, 32))),
                                                         (3, (slice(0, 64), slice(32, 64)))]
    expert = next(pu for pu in units if pu.unit.rule.scope == "expert" and pu.unit.index == (0, 5))
    assert [p.holder for p in expert.pieces] == [1] and expert.pieces[0].dst == (slice(0, 64), slice(0, 64))
    # every unit in exactly one bucket of its own sender, in mapping order per sender; buckets within the bound
    # unless a single unit is larger
    flat = [pu for b in buckets for pu in b.units]
    assert sorted(map(id, flat)) == sorted(map(id, units))
    for bucket in buckets:
        assert all(pu.sender == bucket.sender for pu in bucket.units)
        assert bucket.nbytes <= bucket_bytes or len(bucket.units) == 1
    if bucket_bytes >= 1 << 30:
        assert [b.sender for b in buckets] == [0, 2]  # one bucket per stage


def test_cuda_ipc_sync_is_sglang_only():
    from mpo.config import RECIPES
    from mpo.config import ConfigError
    from mpo.config_checks import load_config

    with pytest.raises(ConfigError, match="sync.transport='cuda_ipc' is SGLang's colocated GPU path"):
        load_config(RECIPES / "demo_cpu.yaml", ["sync.transport=cuda_ipc"])
    with pytest.raises(ConfigError, match="sync.transport"):
        load_config(RECIPES / "demo_cpu.yaml", ["sync.transport=ipc"])  # not a transport


def test_to_hf_views_are_the_hf_values_without_copies():
    """The shm sync pushes ModelMapping.to_hf(views=True): for every unit of a model with grouped-query attention,
    each part is a view into the unit's tensor (no copy) whose row-major values equal the HF tensor to_hf makes
    (the engine copies it into a buffer of the HF shape), and a q/k/v view is strided (not one contiguous run)."""
    import torch

    cfg = preset("sync_bench_1l")
    mapping = mapping_for(cfg, spec="local")
    generator = torch.Generator().manual_seed(0)
    strided = 0
    for unit in mapping.units():
        tensor = torch.randn(unit.rule.unit_shape, generator=generator)
        if unit.rule.kind == "vocab":
            tensor = torch.randn((cfg.vocab_size + 64, *unit.rule.unit_shape[1:]), generator=generator)
        copies, views = mapping.to_hf(unit, tensor), mapping.to_hf(unit, tensor, views=True)
        assert [n for n, _ in copies] == [n for n, _ in views] == list(unit.hf_names)
        for (_, hf), (_, view), shape in zip(copies, views, unit.rule.hf_shapes):
            assert tuple(hf.shape) == tuple(shape) and view.numel() == hf.numel()
            assert view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            assert torch.equal(view.reshape(shape), hf)
            strided += not view.is_contiguous()
    assert strided == 3 * cfg.num_layers  # q, k and v of every layer (two head groups: none is one run)
