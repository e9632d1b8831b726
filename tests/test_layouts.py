"""Same weights -> same logits, log-probs and gradients at every parallel layout (real megatron-core, real gloo).

The reference is megatron-core itself at TP1 on one rank. Each layout loads the reference's torch_dist checkpoint
through megatron's resharding, splits the same 4-row batch over its data-parallel ranks, and runs forward+backward
through megatron's schedules (1F1B under PP) and DDP. Gradients are gathered to full tensors with megatron's sharding
metadata and compared tensor by tensor.
"""

from __future__ import annotations

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
