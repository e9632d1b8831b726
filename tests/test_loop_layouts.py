"""The RL loop's first step is layout-free: loss, old log-probs and gathered gradients at TP2, PP2, EP2, TP2xEP2 and
TP2 with expert parallelism and no expert-TP (ETP1) equal data parallelism's (DP2), on rows of different prompt and response lengths, from one converted checkpoint.

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
             "ep2": ["parallel.expert_parallel=2"],
             # context parallelism: every row split into 4 chunks over 2 ranks (mpo.models.context_parallel)
             "cp2": ["parallel.context_parallel=2"],
             # dense weights split over TP2, experts over EP2 with no tensor split inside an expert (ETP1)
             "tp2_ep2_etp1": ["parallel.tensor_parallel=2", "parallel.expert_parallel=2",
                              "parallel.expert_tensor_parallel=1"]}
FOUR_RANKS = {"tp2xep2": ["parallel.tensor_parallel=2", "parallel.expert_parallel=2"],
              "cp2xep2": ["parallel.context_parallel=2", "parallel.expert_parallel=2"],
              "cp2xtp2": ["parallel.context_parallel=2", "parallel.tensor_parallel=2"]}
# Sequence packing (mpo.trainer.packing) on long-tailed rows (prompts 3..40, responses 1..200 tokens): each layout
# packed against DP2 padded (packing off), R3 packed against R3 padded. 256 tokens hold one to four sequences.
PACK = ["schedule.max_tokens_per_microbatch=256", "schedule.micro_batch_size=4"]
CRITIC = ["algorithm.advantage=gae", "algorithm.kl_coef=0.1", "algorithm.critic_warmup_steps=0"]
RSPO = ["algorithm.loss=rspo", "algorithm.replay=r2"]
PACKED_TWO = {"packed-dp2-off": [], "packed-dp2": PACK, "packed-tp2": [*TWO_RANKS["tp2"], *PACK],
              "packed-pp2": [*TWO_RANKS["pp2"], *PACK], "packed-ep2": [*TWO_RANKS["ep2"], *PACK],
              "packed-r3-off": ["algorithm.replay=r3"], "packed-r3": ["algorithm.replay=r3", *PACK],
              # context parallelism with packed rows, and with R3 replay (each CP rank replays its chunks)
              "packed-cp2": ["parallel.context_parallel=2", *PACK],
              "packed-cp2-r3": ["parallel.context_parallel=2", "algorithm.replay=r3", *PACK],
              "packed-cp2-critic": ["parallel.context_parallel=2", *CRITIC, *PACK],
              # the reference pass (KL), the critic's values and update (GAE); RSPO's router-shift gammas under R2
              "packed-critic-off": CRITIC, "packed-critic": [*CRITIC, *PACK],
              "packed-rspo-off": RSPO, "packed-rspo": [*RSPO, *PACK]}
PACKED_FOUR = {"packed-tp2xep2": [*FOUR_RANKS["tp2xep2"], *PACK]}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("loop_layouts")
    hf = make_tiny_qwen3_moe(base / "hf", vocab=loop_layout_worker.VOCAB)
    hf_to_mcore(hf, base / "mc", show_progress=False)
    spawn_ranks(2, loop_layout_worker.run, str(base), str(hf), str(base / "mc"), {**TWO_RANKS, **PACKED_TWO})
    spawn_ranks(4, loop_layout_worker.run, str(base), str(hf), str(base / "mc"), {**FOUR_RANKS, **PACKED_FOUR})
    return {name: torch.load(base / f"{name}.pt", weights_only=True)
            for name in (*TWO_RANKS, *FOUR_RANKS, *PACKED_TWO, *PACKED_FOUR)}


def test_loop_layout_reference_is_a_real_step(layout_runs):
    """The DP2 reference has a finite non-zero loss, every response's log-probs and non-zero gradients in every
    tensor that takes part (so equality below is not between empty things)."""
    ref = layout_runs["dp2"]
    assert torch.isfinite(torch.tensor(ref["loss"])) and ref["loss"] != 0.0
    assert len(ref["old_logprobs"]) == 6
    assert len({len(lp) for lp in ref["old_logprobs"].values()}) > 1  # responses of different lengths
    assert ref["grad_norm"] > 0
    assert sum(float(g.abs().sum() > 0) for g in ref["grads"].values()) >= len(ref["grads"]) - 2


def _assert_same_step(ref: dict, got: dict) -> None:
    assert abs(got["loss"] - ref["loss"]) <= TOL
    assert got["old_logprobs"].keys() == ref["old_logprobs"].keys()
    for ids, lp in ref["old_logprobs"].items():
        assert torch.allclose(torch.tensor(got["old_logprobs"][ids]), torch.tensor(lp), atol=TOL, rtol=0), ids
    assert got["grads"].keys() == ref["grads"].keys()
    worst = max((got["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"])
    assert worst <= TOL, f"largest gradient difference {worst:.2e}"


@pytest.mark.parametrize("layout", ["tp2", "pp2", "ep2", "tp2_ep2_etp1", "tp2xep2"], ids=lambda k: f"loop-layout-{k}")
def test_loop_layout_first_step_equals_dp2(layout_runs, layout):
    _assert_same_step(layout_runs["dp2"], layout_runs[layout])


@pytest.mark.parametrize("layout", ["cp2", "cp2xep2", "cp2xtp2"])
def test_context_parallel_loop_first_step_equals_dp2(layout_runs, layout):
    """Context parallelism through the whole step (every row split into 2 x CP chunks, the log-probs gathered back,
    the loss of whole rows on every CP rank, gradients summed by megatron's DDP over DP x CP): DP2's step."""
    _assert_same_step(layout_runs["dp2"], layout_runs[layout])


@pytest.mark.parametrize("layout,reference", [("packed-cp2", "packed-dp2-off"), ("packed-cp2-r3", "packed-r3-off"),
                                              ("packed-cp2-critic", "packed-critic-off")])
def test_context_parallel_packed_r3_and_critic_equal_padded(layout_runs, layout, reference):
    """CP2 with packed rows (the row's block-diagonal mask at global positions), with R3 replay (each CP rank
    replays its chunks of the engine's routes; records gathered back), and with the critic and the KL reference:
    the padded CP1 step, the critic's and KL metrics included (routing agreement metrics are per-DP-rank means, which
    CP2's single DP rank and DP2's two do not share)."""
    ref, got = layout_runs[reference], layout_runs[layout]
    _assert_same_step(ref, got)
    keys = [k for k in ref["metrics"] if k.startswith(("critic/", "kl")) and "time" not in k]
    assert keys or "critic" not in layout, sorted(ref["metrics"])
    for key in keys:
        assert abs(got["metrics"][key] - ref["metrics"][key]) <= TOL * max(1.0, abs(ref["metrics"][key])), key


def test_packed_reference_rows_are_long_tailed(layout_runs):
    """The packing reference (DP2, padded) trains on 8 responses of 1..200 tokens after prompts of 3..40."""
    ref = layout_runs["packed-dp2-off"]
    assert torch.isfinite(torch.tensor(ref["loss"])) and ref["loss"] != 0.0 and ref["grad_norm"] > 0
    lengths = sorted(len(lp) for lp in ref["old_logprobs"].values())
    assert len(lengths) == 8 and lengths[0] == 1 and lengths[-1] == 200


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "ep2", "tp2xep2", "r3", "critic", "rspo"],
                         ids=lambda k: f"packed-{k}")
def test_packed_first_step_equals_padded(layout_runs, layout):
    """Packing on (256-token micro-batches, balanced DP shares) gives the padded step's loss, every response's old
    log-probs and the gathered gradients; layouts against DP2 padded, R3 / GAE+KL / RSPO against themselves padded
    (with the critic's values and value loss, the KL term and the router shift in the metrics)."""
    reference = f"packed-{layout}-off" if layout in ("r3", "critic", "rspo") else "packed-dp2-off"
    ref, got = layout_runs[reference], layout_runs[f"packed-{layout}"]
    _assert_same_step(ref, got)
    keys = [k for k in ref["metrics"] if k.startswith(("critic/", "kl", "rspo", "router")) and "time" not in k]
    if layout in ("critic", "rspo"):
        assert keys, sorted(ref["metrics"])
    for key in keys:
        assert abs(got["metrics"][key] - ref["metrics"][key]) <= TOL * max(1.0, abs(ref["metrics"][key])), key


def test_packed_sequences_do_not_attend_to_each_other(layout_runs):
    """Two sequences in one packed row: a different first sequence leaves the second's log-probs where they were..."""
    probe = layout_runs["packed-dp2"]["isolation"]
    assert probe["perturbed_maxdiff"] > 1e-2  # the first sequence's own log-probs do change
    assert probe["other_maxdiff"] <= 1e-6
    # ... and equal the same sequence run alone from position 0: RoPE over the row's continuous positions (local
    # spec) gives each block the attention of restarted positions
    assert probe["alone_maxdiff"] <= TOL
