"""Same weights -> same logits, log-probs and gradients at every parallel layout (real megatron-core, real gloo).

The reference is megatron-core itself at TP1 on one rank. Each layout loads the reference's torch_dist checkpoint
through megatron's resharding, splits the same 4-row batch over its data-parallel ranks, and runs forward+backward
through megatron's schedules (1F1B under PP) and DDP. Gradients are gathered to full tensors with megatron's sharding
metadata and compared tensor by tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import layout_worker
from helpers.spawn import spawn_ranks

TOL = 1e-5

LAYOUTS = {
    "tp2": (2, dict(tensor_parallel=2)),
    "ep2": (2, dict(expert_parallel=2)),
    "pp2": (2, dict(pipeline_parallel=2)),
    "tp2xep2": (4, dict(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1)),
    "tp2xep2-etp2": (4, dict(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=2)),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "tp1"
    out.mkdir()
    spawn_ranks(1, layout_worker.run, str(out), {}, None, True)
    return out.parent, layout_worker.load_outputs(out)


@pytest.mark.parametrize("name", list(LAYOUTS), ids=[f"layout-{n}" for n in LAYOUTS])
def test_layout_matches_tp1(name, reference):
    base, reference = reference
    world, layout = LAYOUTS[name]
    out = base / name
    out.mkdir()
    spawn_ranks(world, layout_worker.run, str(out), layout)
    got = layout_worker.load_outputs(out)

    for key in ("logits", "logprobs", "entropy"):
        diff = (got[key] - reference[key]).abs().max().item()
        assert diff <= TOL, f"{name}: {key} differ from TP1 by {diff:.3g}"
    assert reference["logprobs"].abs().sum() > 0  # the comparison saw real numbers

    assert got["grads"].keys() == reference["grads"].keys()
    for key, ref in reference["grads"].items():
        diff = (got["grads"][key] - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert diff <= TOL * max(1.0, scale), f"{name}: grad {key} differs from TP1 by {diff:.3g} (max {scale:.3g})"
    assert any(g.abs().sum() > 0 for k, g in reference["grads"].items() if "experts" in k)


def _assert_matches(name: str, got: dict, reference: dict) -> None:
    """Outputs, gradients and the weights after one Adam step equal the TP1 reference's within TOL."""
    for key in ("logits", "logprobs", "entropy"):
        diff = (got[key] - reference[key]).abs().max().item()
        assert diff <= TOL, f"{name}: {key} differ from TP1 by {diff:.3g}"
    for part in ("grads", "stepped"):
        assert got[part].keys() == reference[part].keys(), name
        for key, ref in reference[part].items():
            diff = (got[part][key] - ref).abs().max().item()
            assert diff <= TOL * max(1.0, ref.abs().max().item()), f"{name}: {part} {key} differs by {diff:.3g}"
    assert reference["logprobs"].abs().sum() > 0


# Uneven and virtual pipeline stages: (world, layers, layout). 3 and 5 layers cannot be split evenly over PP2 / PP4.
UNEVEN = {
    "3layers-pp2-first1": (2, 3, dict(pipeline_parallel=2, num_layers_in_first_stage=1)),
    "5layers-pp2-last2": (2, 5, dict(pipeline_parallel=2, num_layers_in_last_stage=2)),
    "4layers-pp2-vpp2": (2, 4, dict(pipeline_parallel=2, virtual_pipeline_parallel=2)),
    "5layers-pp4-first2": (4, 5, dict(pipeline_parallel=4, num_layers_in_first_stage=2)),
}


@pytest.fixture(scope="module")
def uneven_runs(tmp_path_factory):
    """Every uneven layout and its TP1 references, one process start-up per world size (shared set-up)."""
    base = tmp_path_factory.mktemp("uneven")
    refs = {n: base / f"tp1-{n}layers" for n in (3, 4, 5)}
    for directory in refs.values():
        directory.mkdir()
    spawn_ranks(1, layout_worker.run_many, [dict(out_dir=str(d), layout={}, save_checkpoint=True, num_layers=n)
                                            for n, d in refs.items()])
    for world in (2, 4):
        jobs = [dict(out_dir=str(base / name), layout=layout, num_layers=layers)
                for name, (w, layers, layout) in UNEVEN.items() if w == world]
        for job in jobs:
            Path(job["out_dir"]).mkdir()
        spawn_ranks(world, layout_worker.run_many, jobs)
    return {name: (layout_worker.load_outputs(base / name), layout_worker.load_outputs(refs[layers]))
            for name, (_, layers, _) in UNEVEN.items()}


@pytest.mark.parametrize("name", list(UNEVEN), ids=[f"uneven_pp-{n}" for n in UNEVEN])
def test_uneven_pp_step_matches_tp1(name, uneven_runs):
    got, reference = uneven_runs[name]
    _assert_matches(name, got, reference)


def test_uneven_pp_stage_layers_match_megatron_placement():
    """stage_layers (the plan's and the checks' placement) against megatron's own offset and layer-count functions,
    evaluated for every rank and virtual stage without a process group."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mpo.models.builder import transformer_config
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, detect_device

    cases = [(3, dict(pipeline_parallel=2, num_layers_in_first_stage=1)),
             (61, dict(pipeline_parallel=8, num_layers_in_first_stage=5)),
             (61, dict(pipeline_parallel=16, num_layers_in_first_stage=3, num_layers_in_last_stage=2,
                       virtual_pipeline_parallel=None)),
             (94, dict(pipeline_parallel=4, num_layers_in_first_stage=22, num_layers_in_last_stage=24,
                       virtual_pipeline_parallel=2)),
             (8, dict(pipeline_parallel=2, virtual_pipeline_parallel=2))]
    for layers, layout in cases:
        parallel = ParallelConfig(**layout)
        config = transformer_config(preset("tiny").with_overrides(num_layers=layers), parallel,
                                    detect_device(force_cpu=True))
        placed = parallel.stage_layers(layers)
        for rank in range(parallel.pipeline_parallel):
            for v in range(parallel.vpp):
                vp = v if parallel.virtual_pipeline_parallel else None
                count = get_num_layers_to_build(config, vp_stage=vp, pp_rank=rank)
                offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=rank)
                assert placed[rank][v] == tuple(range(offset, offset + count)), (layers, layout, rank, v)
        assert sorted(i for stage in placed for chunk in stage for i in chunk) == list(range(layers))
