"""Streaming weight sync (mpo.weight_sync.gather) from a 4-rank trainer (real megatron-core, gloo) to a real mpo engine
over HTTP, with no full-model gather in the sync: `gather_full_state` raises if called (helpers/sync_worker)."""

from __future__ import annotations

import json

import pytest

from helpers import sync_worker
from helpers.spawn import spawn_ranks

LAYOUTS = {"tp2xep2": ["parallel.tensor_parallel=2", "parallel.expert_parallel=2"],
           "ep2xpp2": ["parallel.expert_parallel=2", "parallel.pipeline_parallel=2"],
           # pure data parallelism, the layout most users run: ranks 1-3 hold no main copy of any weight (they crashed
           # the streamer's set-up with an IndexError before, issue #24)
           "hardening-dp4": []}
# One sender at TP2xEP2 (the distributed group); two at EP2xPP2, where the transports differ (HTTP senders push
# concurrently, distributed senders each make their own group and take turns). "/gloo": the pieces reach their
# sender over gloo (the path NCCL takes on GPU) instead of being written into its shared-memory slot (the CPU
# default; strided in place for TP2's row-parallel slices). "shm": the engine reads the buckets from those slots.
# The first transport's EngineSet starts the engine.
TRANSPORTS = {"tp2xep2": ["shm", "distributed/gloo"], "ep2xpp2": ["tensor/gloo", "distributed", "shm"],
              "hardening-dp4": ["shm", "tensor/gloo"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_streaming_sync_reaches_the_engine_without_a_full_gather(tmp_path, layout):
    race = layout == "hardening-dp4"  # and async mode's engine restart racing the next sync (below)
    spawn_ranks(4, sync_worker.streaming, str(tmp_path), LAYOUTS[layout], TRANSPORTS[layout], race)
    results = json.loads((tmp_path / "sync.json").read_text())
    if race:
        assert results["restart_race"] == {"restarted": True, "engine_matches_full_gather": True}, results
        assert results["death_race"] == {"restarted": True, "engine_matches_full_gather": True, "stale": []}, results
    assert results["leftover_after_stop"] == []
    assert results["mpo_path"].startswith(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    for transport in TRANSPORTS[layout]:
        got = results[transport]
        assert got["shared"] == (not transport.endswith("/gloo"))
        assert got["leftover_shm_files"] == [], "a sync left its shared-memory slots behind"
        assert got["engine_changed"], f"{transport}: the engine still has its initial weights"
        assert got["engine_matches_full_gather"], f"{transport}: engine weights differ from the trainer's"
        metrics = got["metrics"]
        assert metrics["sync_bytes"] > 0 and metrics["sync_buckets"] > 1
        assert metrics["sync_senders"] == (2 if layout == "ep2xpp2" else 1)
