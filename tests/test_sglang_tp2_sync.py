"""Streaming weight sync from a 4-rank trainer (TP2xEP2 and EP2xPP2, real megatron-core over gloo) into a REAL
sglang 0.5.23 server running at `--tp 2` on CPU (tests/sglang_harness: its CPU guards; one core per TP rank), over
both transports, verified by the loop's covering probe (every expert of every layer routed to at least once; the
server's log-probs must equal the trainer's to 1e-3 in fp32). Before each sync the same probe must fail (the
trainer's weights were perturbed), so the check is not vacuous. `gather_full_state` raises during the sync.
One server for the module; without SGLang every test skips with "SGLANG TIER SKIPPED: ..." (fails in CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import sync_worker
from helpers.sglang_server import serve_module
from helpers.spawn import spawn_ranks
from helpers.tiny_hf import make_tiny_qwen3_moe

LAYOUTS = {"tp2xep2": ["parallel.tensor_parallel=2", "parallel.expert_parallel=2"],
           "ep2xpp2": ["parallel.expert_parallel=2", "parallel.pipeline_parallel=2"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe_tp2"), seed=5, vocab=256)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, model_dir: Path):
    yield from serve_module(request, model_dir, extra_args=["--tp", "2"],
                            env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})


@pytest.fixture(scope="module")
def mcore_dir(model_dir: Path, tmp_path_factory) -> Path:
    from checkpoints_tools import hf_to_mcore

    out = tmp_path_factory.mktemp("tp2_mcore") / "mc"
    hf_to_mcore(model_dir, out, show_progress=False)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_streaming_sync_into_sglang_tp2(server, model_dir, mcore_dir, tmp_path, layout):
    spawn_ranks(4, sync_worker.sglang_streaming, str(tmp_path), str(model_dir), str(mcore_dir), server.url, 2,
                LAYOUTS[layout], ["tensor", "distributed"])
    results = json.loads((tmp_path / "sglang_sync.json").read_text())
    for transport in ("tensor", "distributed"):
        got = results[transport]
        assert got["tp_sizes"] == [2]  # from the server's own /server_info
        assert got["stale_error"] and "probe log-probs differ" in got["stale_error"]
        assert got["metrics"]["sync_probe_logprob_maxdiff"] <= 1e-3
        assert got["metrics"]["sync_bytes"] > 0
        assert got["metrics"]["sync_senders"] == (2 if layout == "ep2xpp2" else 1)
