"""The memory plan (mpo.memory_plan) against real allocations, and the shipped GPU recipes against an 80 GB H100.

Reference: megatron-core itself. 8 gloo ranks build the policy at TP2 x EP2 x PP2 (expert-TP 1, DP2, expert-DP2) in
bf16 with the fp32 LM head, wrap it in megatron DDP (fp32 grad buffers) and create megatron's optimizer with and
without the distributed optimizer, allocating its Adam state; the bytes of those tensors are counted per rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import memory_worker
from helpers.spawn import spawn_ranks
from mpo.memory_plan import model_memory, stage_params
from mpo.models.config import MoEModelConfig
from mpo.parallel import ParallelConfig

REPO = Path(__file__).resolve().parents[1]
LAYOUT = dict(tensor_parallel=2, expert_parallel=2, pipeline_parallel=2, expert_tensor_parallel=1)


@pytest.fixture(scope="module")
def allocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    spawn_ranks(8, memory_worker.run, str(out), LAYOUT)
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize("distributed", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
def test_plan_bytes_equal_allocated_tensors_at_tp2_ep2_pp2(allocated, distributed):
    cfg, parallel = MoEModelConfig(**memory_worker.MODEL), ParallelConfig(**LAYOUT)
    assert len(allocated) == 8
    for rank in allocated:
        plan = model_memory(stage_params(cfg, parallel, rank["pp_rank"]), bf16=True, fp32_head=True,
                            data_parallel=2, expert_data_parallel=2, distributed_optimizer=distributed)
        got = rank["distributed" if distributed else "plain"]
        for item in ("params", "grads", "optimizer"):
            planned = getattr(plan, item)
            print(f"pp{rank['pp_rank']} {item}: plan {planned} allocated {got[item]} "
                  f"({(planned - got[item]) / got[item]:+.2%})")
            assert abs(planned - got[item]) <= 0.02 * got[item], (item, rank["pp_rank"], planned, got[item])
    # the distributed optimizer really shards: half the optimizer bytes at DP2 / expert-DP2
    assert all(r["distributed"]["optimizer"] < 0.6 * r["plain"]["optimizer"] for r in allocated)


def test_plan_routing_records_equal_a_real_session(tmp_path):
    """mpo plan's routing bookkeeping against real captures on the tiny model (3 micro-batches): an old-logprob pass's
    records without router log-probs (no replay: chosen experts only), and under R2 with them (chosen and natural
    experts, fp32 log-probs, as RSPO needs), byte for byte; and the pass's int64 replay indices are freed after each
    routing call (none alive at the end of a forward-only pass, of one made per micro-batch and MoE layer)."""
    from helpers import routing_worker

    spawn_ranks(1, routing_worker.run_memory, str(tmp_path))
    got = json.loads((tmp_path / "routing_memory.json").read_text())
    for name in ("none", "r2_rspo"):
        assert got[name]["measured"] > 0 and got[name]["measured"] == got[name]["planned"], got
    assert got["r2_rspo"]["measured"] > 4 * got["none"]["measured"]  # the fp32 log-probs dominate when recorded
    assert got["r2_rspo_int64_made"] >= 3 and got["r2_rspo_int64_alive"] == 0, got
