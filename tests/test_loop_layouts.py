"""The RL loop's first step is layout-free: loss, old log-probs and gathered gradients at TP2, PP2, EP2 and TP2xEP2
equal data parallelism's (DP2), on rows of different prompt and response lengths, from one converted checkpoint.

The reference is megatron-core at another layout (DP2: every rank holds the whole model, no tensor, pipeline or
expert split); each layout runs the real Trainer (sequence parallelism under TP, megatron's pipeline schedule under
PP, token dispatch under EP). The rollouts are fixed rows instead of an engine's: what is compared is the step.
"""

from __future__ import annotations

import os

import pytest
import torch

from checkpoints_tools import hf_to_mcore
from helpers import loop_layout_worker
from helpers.spawn import spawn_ranks
from helpers.tiny_hf import make_tiny_qwen3_moe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL = 1e-5
TWO_RANKS = {"dp2": [], "tp2": ["parallel.tensor_parallel=2"], "pp2": ["parallel.pipeline_parallel=2"],
             "ep2": ["parallel.expert_parallel=2"]}
FOUR_RANKS = {"tp2xep2": ["parallel.tensor_parallel=2", "parallel.expert_parallel=2"]}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("loop_layouts")
    hf = make_tiny_qwen3_moe(base / "hf", vocab=loop_layout_worker.VOCAB)
    hf_to_mcore(hf, base / "mc", show_progress=False)
    spawn_ranks(2, loop_layout_worker.run, str(base), str(hf), str(base / "mc"), TWO_RANKS)
    spawn_ranks(4, loop_layout_worker.run, str(base), str(hf), str(base / "mc"), FOUR_RANKS)
    return {name: torch.load(base / f"{name}.pt", weights_only=True) for name in (*TWO_RANKS, *FOUR_RANKS)}


def test_loop_layout_reference_is_a_real_step(layout_runs):
    """The DP2 reference has a finite non-zero loss, every response's log-probs and non-zero gradients in every
    tensor that takes part (so equality below is not between empty things)."""
    ref = layout_runs["dp2"]
    assert torch.isfinite(torch.tensor(ref["loss"])) and ref["loss"] != 0.0
    assert len(ref["old_logprobs"]) == 6
    assert len({len(lp) for lp in ref["old_logprobs"].values()}) > 1  # responses of different lengths
    assert ref["grad_norm"] > 0
    assert sum(float(g.abs().sum() > 0) for g in ref["grads"].values()) >= len(ref["grads"]) - 2


@pytest.mark.parametrize("layout", ["tp2", "pp2", "ep2", "tp2xep2"], ids=lambda k: f"loop-layout-{k}")
def test_loop_layout_first_step_equals_dp2(layout_runs, layout):
    ref, got = layout_runs["dp2"], layout_runs[layout]
    assert abs(got["loss"] - ref["loss"]) <= TOL
    assert got["old_logprobs"].keys() == ref["old_logprobs"].keys()
    for ids, lp in ref["old_logprobs"].items():
        assert torch.allclose(torch.tensor(got["old_logprobs"][ids]), torch.tensor(lp), atol=TOL, rtol=0), ids
    assert got["grads"].keys() == ref["grads"].keys()
    worst = max((got["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"])
    assert worst <= TOL, f"largest gradient difference {worst:.2e}"
