"""Sequence packing's host-side pieces (mpo.trainer.packing, mpo.models.packed) against brute-force references; the
packed training step itself is compared with padded rows in tests/test_loop_layouts.py (test ids `packed`)."""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import pytest
import torch

from mpo.config import ConfigError
from mpo.config_checks import load_config
from mpo.models.packed import PackedLayout
from mpo.trainer.packing import first_fit_bins, karmarkar_karp, pack_pass
from mpo.trainer.rows import Sample

REPO = Path(__file__).resolve().parents[1]


def _best_spread(lengths: list[int], parts: int) -> int:
    """The optimal max-min spread of a `parts`-way partition, by trying every assignment."""
    best = None
    for assign in itertools.product(range(parts), repeat=len(lengths)):
        sums = [0] * parts
        for n, p in zip(lengths, assign):
            sums[p] += n
        spread = max(sums) - min(sums)
        best = spread if best is None else min(best, spread)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_packed_karmarkar_karp_partitions_and_balances(seed):
    """Every index once; the spread is within the largest item of the optimum (brute force), and on a long-tailed
    set far better than round-robin."""
    rng = random.Random(seed)
    lengths = [int(rng.lognormvariate(4, 1)) + 1 for _ in range(9)]
    for parts in (2, 3):
        sets = karmarkar_karp(lengths, parts)
        assert sorted(i for s in sets for i in s) == list(range(len(lengths)))
        sums = [sum(lengths[i] for i in s) for s in sets]
        assert max(sums) - min(sums) <= _best_spread(lengths, parts) + max(lengths) // 2
    tail = [1000] + [10] * 99
    sums = [sum(tail[i] for i in s) for s in karmarkar_karp(tail, 2)]
    assert max(sums) - min(sums) <= 10  # round-robin: 1490 vs 500


def test_packed_first_fit_respects_budget_and_row_cap():
    lengths = {i: n for i, n in enumerate([300, 120, 90, 90, 60, 40, 40, 10, 5, 700])}
    bins = first_fit_bins(lengths, 256, 3)
    assert sorted(i for b in bins for i in b) == sorted(lengths)
    for b in bins:
        assert len(b) <= 3
        assert sum(lengths[i] for i in b) <= 256 or len(b) == 1  # an over-long sample alone
    assert sum(len(b) == 1 and lengths[b[0]] > 256 for b in bins) == 2


def test_packed_layout_moves_tokens_and_masks_attention():
    """unpack / pack against per-sequence slicing; the mask against a query-by-key loop."""
    lens = [5, 1, 7]
    layout = PackedLayout.build(lens, 16, thd=False)
    assert layout.seq_lens == (5, 1, 7, 3)
    assert layout.position_ids()[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    row = torch.arange(16.0)[None] + 1
    rows = layout.unpack(row)
    starts = [0, 5, 6]
    for i, (start, n) in enumerate(zip(starts, lens)):
        assert rows[i, :n].tolist() == row[0, start:start + n].tolist() and not rows[i, n:].any()
    back = layout.pack(rows)
    assert back[0, :13].tolist() == row[0, :13].tolist() and not back[0, 13:].any()
    mask = layout.attention_mask("cpu")[0, 0]
    seq_of = [i for i, n in enumerate(layout.seq_lens) for _ in range(n)]
    for q in range(16):
        for k in range(16):
            assert bool(mask[q, k]) == (k > q or seq_of[k] != seq_of[q]), (q, k)


def test_packed_pass_shapes_under_pp_tp_and_equal_counts():
    """Every DP rank the same number of micro-batches; under PP one [1, S] for the whole pass (S a multiple of TP);
    every sample in exactly one rank's micro-batches, its tokens where the layout says."""
    rng = random.Random(0)
    samples = [Sample(ids=[rng.randrange(4, 200) for _ in range(n)], prompt_len=1, group=0, reward=0.0)
               for n in [3, 41, 200, 7, 90, 15, 66, 120, 5]]
    minis = [samples[0::2], samples[1::2]]
    per_rank = [pack_pass(minis, dp_rank=r, dp_size=2, max_tokens=128, max_rows=3, tp=2, uniform=True)
                for r in range(2)]
    for m in range(2):
        assert len(per_rank[0][m]) == len(per_rank[1][m])
    shapes = {tuple(mb.input_ids.shape) for mbs in per_rank for mini in mbs for mb in mini}
    assert len(shapes) == 1 and next(iter(shapes))[0] == 1 and next(iter(shapes))[1] % 2 == 0
    seen = []
    for mbs in per_rank:
        for mb in (mb for mini in mbs for mb in mini):
            for j, s in enumerate(mb.extras["samples"][: mb.extras["n_real"]]):
                seen.append(id(s))
                got = mb.packing.unpack(mb.input_ids)[j, : len(s.ids)]
                assert got.tolist() == s.ids
                assert mb.extras["mask"][j].sum() == len(s.ids) - 1
    assert sorted(seen) == sorted(id(s) for s in samples)


def test_packed_budget_config_error_is_one_line():
    with pytest.raises(ConfigError, match=re.escape("schedule.max_tokens_per_microbatch=1; valid values: >= 2")):
        load_config(REPO / "mpo/recipes/demo_cpu.yaml", ["schedule.max_tokens_per_microbatch=1"])


def test_packed_plan_accounts_activations_by_the_token_budget():
    """Activations follow the tokens of one micro-batch: a budget of 4 rows' tokens plans what 4 padded rows do, and
    the plan is affine in the budget (every term is linear in the tokens but the fused head's fixed chunk working set
    and weight-gradient sum): doubling the budget from 2 to 4 rows adds twice what doubling from 1 to 2 adds."""
    from mpo.memory_plan import PlanInputs, plan_memory

    recipe = REPO / "mpo/recipes/qwen3_30b_a3b_gspo.yaml"
    seq = 4096
    inputs = PlanInputs(seq_len=seq)

    def activations(*overrides: str) -> int:  # padded rows unless an override packs (the recipe packs)
        config = load_config(recipe, ["schedule.max_tokens_per_microbatch=null", *overrides])
        return plan_memory(config, inputs)[0].items["activations"]

    padded = activations("schedule.micro_batch_size=4")
    assert activations(f"schedule.max_tokens_per_microbatch={4 * seq}") == pytest.approx(padded, rel=1e-9)
    one, two = (activations(f"schedule.max_tokens_per_microbatch={k * seq}") for k in (1, 2))
    assert padded - two == pytest.approx(2 * (two - one), rel=1e-9) and one < two < padded


def test_packed_rows_keep_a_multi_turn_loss_mask():
    """A multi-turn row (mpo.envs) carries loss only on the model's tokens; packed, its mask in the sample layout is
    the same as padded: observation tokens (loss_mask 0) stay out of the loss."""
    from mpo.trainer.rows import rank_microbatches

    turn = Sample(ids=[5, 6, 7, 8, 9, 10, 11], prompt_len=2, group=0, reward=1.0, advantage=1.0,
                  loss_mask=[1.0, 1.0, 0.0, 0.0, 1.0])
    plain = Sample(ids=[5, 6, 7], prompt_len=1, group=0, reward=0.0, advantage=-1.0)
    packed = pack_pass([[turn, plain]], dp_rank=0, dp_size=1, max_tokens=16, max_rows=4)[0]
    padded = rank_microbatches([turn, plain], dp_rank=0, dp_size=1, micro_batch_size=4)
    assert len(packed) == 1 and len(padded) == 1
    masks = {id(s): packed[0].extras["mask"][j] for j, s in enumerate(packed[0].extras["samples"])}
    assert masks[id(turn)][:7].tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert masks[id(plain)][:3].tolist() == [0, 1, 1]
    assert padded[0].extras["mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 1]


def test_plan_counts_the_joined_old_logprob_forwards():
    """schedule.forward_micro_batch_size: the old-logprob pass's joined forwards are planned as a training micro-batch
    of that many rows (an upper bound) when larger than micro_batch_size; packing does not join (unchanged plan)."""
    from mpo.memory_plan import PlanInputs, plan_memory

    recipe = REPO / "mpo/recipes/qwen3_30b_a3b_gspo.yaml"
    inputs = PlanInputs(seq_len=4096)

    def activations(*overrides: str) -> int:  # padded rows unless an override packs (the recipe packs)
        config = load_config(recipe, ["schedule.max_tokens_per_microbatch=null", *overrides])
        return plan_memory(config, inputs)[0].items["activations"]

    base = activations("schedule.micro_batch_size=2")
    assert activations("schedule.micro_batch_size=2", "schedule.forward_micro_batch_size=1") == base
    joined = activations("schedule.micro_batch_size=2", "schedule.forward_micro_batch_size=8")
    assert joined > base and joined == activations("schedule.micro_batch_size=8", "schedule.updates_per_step=64")
    packed = ["schedule.max_tokens_per_microbatch=8192"]
    assert activations(*packed, "schedule.forward_micro_batch_size=8") == activations(*packed)
