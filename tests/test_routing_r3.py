"""R3 (rollout routing replay) alignment against SGLang's documented convention, and the replay-mode comparison."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from helpers import routing_compare_worker
from helpers.spawn import spawn_ranks
from mpo.routing.alignment import (
    RolloutRoutes,
    align_to_scored_tokens,
    decode_sglang_routed_experts,
    place_rollout_routes,
)


def test_routing_decode_sglang_base64_int32():
    # SGLang: base64 of little-endian int32, logical shape [n - 1 - start_len, layers, topk]; built here with struct.
    n, layers, topk = 4, 2, 2
    values = list(range(12))
    encoded = base64.b64encode(struct.pack("<12i", *values)).decode()
    got = decode_sglang_routed_experts(encoded, n, layers, topk)
    assert got.routes.dtype == torch.int32 and got.routes.shape == (3, 2, 2)
    assert got.routes[1, 0].tolist() == [4, 5] and got.routes[2, 1].tolist() == [10, 11]
    with pytest.raises(ValueError):
        decode_sglang_routed_experts(encoded, n + 1, layers, topk)


def test_routing_place_rollout_routes_packed_and_padded():
    # Row 0 packs a 3-token and a 2-token sequence; row 1 is a 4-token sequence with start_len 1; seq_len 6.
    def routes(n, start, base):
        return RolloutRoutes(torch.full((n - 1 - start, 1, 2), base, dtype=torch.int32) +
                             torch.arange(n - 1 - start, dtype=torch.int32)[:, None, None], n, start)

    placed = place_rollout_routes([[routes(3, 0, 10), routes(2, 0, 20)], [routes(4, 1, 30)]], seq_len=6)
    got = placed.indices[..., 0, 0].tolist()
    # position i holds the routing of input token i; each sequence's last token and padding have none (-1)
    assert got[0] == [10, 11, -1, 20, -1, -1]
    assert got[1] == [-1, 30, 31, -1, -1, -1]
    assert placed.layers == (1,)


def test_routing_align_to_scored_tokens():
    x = torch.arange(1, 7, dtype=torch.float32).view(1, 6)
    assert align_to_scored_tokens(x).tolist() == [[0, 1, 2, 3, 4, 5]]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])  # packed: the second sequence's first token scores nothing
    assert align_to_scored_tokens(x, pos).tolist() == [[0, 1, 2, 0, 4, 5]]


def test_routing_compare_replay_modes(tmp_path):
    spawn_ranks(1, routing_compare_worker.run, str(tmp_path))
    report = json.loads((tmp_path / "compare.json").read_text())
    none, r2, r3 = report["none"], report["r2"], report["r3"]
    # The stand-in engine's router differs: the trainer's natural choice disagrees with the rollout routes, also
    # under R3 (agreement is measured on the natural choice), and R3 forces the engine's experts where they differ ...
    assert none["rollout_vs_old/exact_match"] < 1.0 and r3["rollout_vs_old/exact_match"] < 1.0
    assert r3["old_replay/forced_frac"] > 0 and none["old_replay/forced_frac"] == 0.0
    # (each sequence's last token has no engine route and routes naturally: forced over a superset of tokens)
    assert r3["old_replay/forced_frac"] <= 1.0 - r3["rollout_vs_old/exact_match"] + 1e-12
    # ... which brings the old log-probs closer to the rollout's.
    assert r3["logp_absdiff_vs_rollout"] < none["logp_absdiff_vs_rollout"]
    # After the step the router's own choice moves; R2 keeps the old experts, forcing the ones that moved.
    assert none["old_vs_update/router_abs_logdiff"] > 0
    assert r2["old_vs_update/exact_match"] < 1.0
    assert r2["update_replay/forced_frac"] == pytest.approx(1.0 - r2["old_vs_update/exact_match"], abs=1e-12)
    assert none["update_replay/forced_frac"] == 0.0
    for row in report.values():
        assert set(row) >= {"ratio_var", "clipfrac", "logp_absdiff_vs_rollout"}
