"""Long chain-of-thought on paper: the shipped 32k-response Qwen3-30B-A3B recipe fits an 80 GB GPU with at least 10%
headroom in `mpo plan` (the FP32 head fused, no [tokens, vocab] logits counted), and the DeepSeek-V3 recipe states
the longest training row `mpo plan` fits (its comment is checked against the plan, so it stays true)."""

from __future__ import annotations

import re
from pathlib import Path

from mpo.config_checks import load_config
from mpo.memory_plan import GIB, PlanInputs, longest_trainer_row, plan_memory

REPO = Path(__file__).resolve().parents[1]
QWEN_32K = REPO / "mpo/recipes/qwen3_30b_a3b_gspo_32k.yaml"
DSV3 = REPO / "mpo/recipes/deepseek_v3_gspo.yaml"


def test_long_context_qwen3_32k_recipe_fits_80gb_with_10_percent_headroom():
    config = load_config(QWEN_32K, [])
    assert config.rollout.max_new_tokens >= 32768 and config.schedule.max_tokens_per_microbatch
    trainer = [r for r in plan_memory(config, PlanInputs()) if r.role.startswith("trainer")]
    assert trainer and all(r.fits and r.capacity - r.total >= 0.10 * r.capacity for r in trainer), \
        [(r.role, r.total / GIB) for r in trainer]


def test_long_context_plan_head_grows_by_hidden_not_vocab_per_token():
    """Doubling the row adds per token what the fused head keeps (fp32 hidden and stats), never 8 x vocab bytes."""
    config = load_config(QWEN_32K, ["schedule.max_tokens_per_microbatch=null", "model.recompute=true"])
    act = {seq: plan_memory(config, PlanInputs(seq_len=seq))[0].items["activations"] for seq in (16384, 32768)}
    per_token = (act[32768] - act[16384]) / 16384
    assert per_token < 8 * 151_936, per_token  # whole fp32 logits and their gradient alone would be 1.2 MB a token


def test_long_context_deepseek_v3_recipe_states_its_longest_row(capsys):
    from mpo.cli import main

    config = load_config(DSV3, [])
    longest = longest_trainer_row(config, PlanInputs())
    stated = re.search(r"longest\s+#?\s*training row that fits at ([\d,]+) tokens", DSV3.read_text())
    assert stated and int(stated.group(1).replace(",", "")) == longest, (stated, longest)
    capsys.readouterr()
    code = main(["plan", "--config", str(DSV3)])
    out = capsys.readouterr().out
    assert code == 0 and f"longest training row that fits the trainer: {longest:,} tokens" in out


def test_context_parallel_plan_divides_the_per_token_terms():
    """CP2 holds half of every row on each rank: the activations' per-token growth halves and the longest row that
    fits grows (the DP ranks halve too, so the optimizer's shards do not change: the distributed optimizer shards over
    DP x CP)."""
    growth = {}
    for cp in (1, 2):
        config = load_config(QWEN_32K, ["schedule.max_tokens_per_microbatch=null", f"parallel.context_parallel={cp}"])
        act = {seq: plan_memory(config, PlanInputs(seq_len=seq))[0].items["activations"] for seq in (16384, 32768)}
        growth[cp] = (act[32768] - act[16384]) / 16384
    assert abs(growth[2] - growth[1] / 2) <= 1e-6 * growth[1], growth
    longest = {cp: longest_trainer_row(load_config(QWEN_32K, [f"parallel.context_parallel={cp}"]), PlanInputs())
               for cp in (1, 2)}
    assert longest[2] > 1.5 * longest[1], longest
    optimizer = {cp: plan_memory(load_config(QWEN_32K, [f"parallel.context_parallel={cp}"]), PlanInputs())[0]
                 .items["policy optimizer"] for cp in (1, 2)}
    assert optimizer[1] == optimizer[2], optimizer
