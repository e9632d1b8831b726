"""Rollout data at scale (issue #31): compact routes on the wire (mpo's frames, SGLang's JSON decoded once) and the
scatter of a step's samples (each data-parallel rank its share, each pipeline stage its layers' routes).

References: the rows each rank builds from the whole batch (mpo.trainer.rows / packing, what every rank did before the
scatter), plain numpy slicing of the engine's array, and the SGLang base64 int32 bytes themselves.
"""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
import torch
import torch.distributed as dist

from helpers.spawn import spawn_ranks
from mpo.rollout.frames import CONTENT_TYPE, MAGIC, decode_frames, encode_frames, frames_answer, sglang_json
from mpo.rollout.protocol import GenerateRequest, GenerateResult, SamplingParams, compact_routes
from mpo.trainer.distribute import Distributor, dp_owners, share_for
from mpo.trainer.packing import pack_pass
from mpo.trainer.rows import Elsewhere, Sample, rank_microbatches

LAYERS, TOPK, EXPERTS = 6, 2, 16


def _samples(n: int, seed: int = 0, routes: bool = True) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, length = int(rng.integers(2, 9)), int(rng.integers(1, 60))
        ids = rng.integers(4, 200, prompt + length).tolist()
        out.append(Sample(ids=ids, prompt_len=prompt, group=i // 2, reward=float(i % 2),
                          advantage=rng.standard_normal(length).tolist() if i % 3 else 0.5,
                          rollout_logprobs=(-rng.random(length)).tolist(),
                          routes=rng.integers(0, EXPERTS, (prompt + length - 1, LAYERS, TOPK)).astype(np.uint8)
                          if routes else None,
                          versions=[3] * length, loss_mask=[1.0] * length))
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("updates", [1, 2, 3])
def test_dp_owners_match_the_rows_each_rank_builds(packed, updates):
    """dp_owners names the rank whose micro-batches hold each sample, as rows/packing split the whole batch."""
    samples = _samples(23, seed=updates)
    minis = [samples[u::updates] for u in range(updates)]
    owners = dp_owners([len(s.ids) for s in samples], updates=updates, dp_size=2, packed=packed)
    index = {id(s): i for i, s in enumerate(samples)}
    for dp_rank in range(2):
        if packed:
            mbs = [mb for mini in pack_pass(minis, dp_rank=dp_rank, dp_size=2, max_tokens=96, max_rows=4)
                   for mb in mini]
        else:
            mbs = [mb for m in minis for mb in rank_microbatches(m, dp_rank=dp_rank, dp_size=2, micro_batch_size=3)]
        held = sorted(index[id(s)] for mb in mbs for s in mb.extras["samples"][: mb.extras["n_real"]])
        assert held == [i for i, o in enumerate(owners) if o == dp_rank]


def test_share_cuts_routes_to_the_stage_and_keeps_others_as_lengths():
    samples = _samples(6)
    owners = [0, 1, 0, 1, 1, 0]
    stage = (4, 5, 6)  # the second of two stages: layer numbers 4..6 are the engine's layers 3..5
    share = share_for(samples, owners, 1, stage, num_layers=LAYERS)
    for s, got, owner in zip(samples, share, owners):
        assert len(got.ids) == len(s.ids) and got.prompt_len == s.prompt_len and got.reward == s.reward
        if owner != 1:
            assert isinstance(got.ids, Elsewhere) and got.routes is None
            with pytest.raises(RuntimeError, match="another data-parallel rank"):
                list(got.ids)
            with pytest.raises((RuntimeError, ValueError)):
                torch.as_tensor(got.ids)
            continue
        assert got.ids.tolist() == s.ids and got.route_layers == stage
        assert np.array_equal(got.routes, s.routes[:, 3:6]) and got.routes.dtype == np.uint8
        assert np.array_equal(got.rollout_logprobs, np.float32(s.rollout_logprobs))
        assert np.array_equal(got.advantage, np.float32(s.advantage)) or got.advantage == s.advantage
        assert got.versions is None  # rank 0 keeps them
    # the whole batch pickled is what each rank used to receive; a share carries half the samples, half the layers
    whole, mine = len(pickle.dumps(samples, protocol=5)), len(pickle.dumps(share, protocol=5))
    assert mine < whole / 3


def test_routes_rows_equal_whole_batch_rows():
    """A stage's rows from its share (numbers and placed routes) equal the rows it built from the whole batch."""
    from mpo.routing import RolloutRoutes, place_rollout_routes

    samples = _samples(8)
    owners = dp_owners([len(s.ids) for s in samples], updates=1, dp_size=2, packed=False)
    share = share_for(samples, owners, 0, (1, 2), num_layers=LAYERS)
    whole = rank_microbatches(samples, dp_rank=0, dp_size=2, micro_batch_size=4)
    mine = rank_microbatches(share, dp_rank=0, dp_size=2, micro_batch_size=4)
    for a, b in zip(whole, mine):
        assert torch.equal(a.input_ids, b.input_ids)
        for key in ("mask", "advantages", "rollout_logprobs", "group_ids", "rewards"):
            assert torch.equal(a.extras[key], b.extras[key]), key
        seq = a.input_ids.shape[1]
        placed_a = place_rollout_routes([[RolloutRoutes(torch.from_numpy(s.routes), len(s.ids))]
                                         for s in a.extras["samples"]], seq).select((1, 2))
        placed_b = place_rollout_routes([[RolloutRoutes(torch.from_numpy(s.routes), len(s.ids))]
                                         for s in b.extras["samples"]], seq, (1, 2))
        assert placed_b.layers == (1, 2) and torch.equal(placed_a.indices, placed_b.indices)


def _distribute_worker(out: str) -> None:
    """4 gloo ranks as DP2 x PP2 (rank r: dp r % 2, stage r // 2 of layers 1-3 / 4-6)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp_rank, layers = rank % 2, ((1, 2, 3), (4, 5, 6))[rank // 2]
    republished = []
    distributor = Distributor(dist.group.WORLD, dp_rank=dp_rank, layers=layers, num_layers=LAYERS)
    distributor.on_republish = lambda: republished.append(dist.all_reduce(torch.ones(1)) or 1)
    samples = _samples(10) if rank == 0 else None
    if rank == 0:  # a sync-mode collect that found its engines stale: every rank publishes (a collective) again
        distributor.republish()
    got = distributor(samples, updates=2, dp_size=2, packed=False)
    assert republished == [1]
    reference = _samples(10)
    owners = dp_owners([len(s.ids) for s in reference], updates=2, dp_size=2, packed=False)
    for s, g, owner in zip(reference, got, owners):
        assert len(g.ids) == len(s.ids)
        if owner == dp_rank:
            assert g.ids.tolist() == s.ids and g.route_layers == layers
            assert np.array_equal(g.routes, s.routes[:, layers[0] - 1:layers[-1]])
        else:
            assert isinstance(g.ids, Elsewhere)
    empty = distributor([] if rank == 0 else None, updates=2, dp_size=2, packed=True)  # a step with no signal
    assert empty == []
    dist.barrier()
    if rank == 0:
        open(out, "w").write("ok")
    dist.destroy_process_group()


def test_distributor_sends_each_rank_its_share_and_stage(tmp_path):
    out = tmp_path / "ok"
    spawn_ranks(4, _distribute_worker, str(out))
    assert out.read_text() == "ok"


# -- the wire -------------------------------------------------------------------------------------------------------
def _answer(rows: int, routes: np.ndarray) -> dict:
    return {"text": "", "output_ids": [7, 8], "meta_info": {
        "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.25, 7, None], [-1.5, 8, None]],
        "output_token_weight_versions": ["3", "3"], "routed_experts": routes}}


def test_frames_and_sglang_json_decode_to_the_same_compact_routes():
    request = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=2), return_routed_experts=True)
    rng = np.random.default_rng(1)
    routes = rng.integers(0, 200, (4, LAYERS, TOPK))
    answer = _answer(4, compact_routes(routes, 200))
    # SGLang's JSON: base64 of little-endian int32, the bytes of the int32 array itself
    body = json.loads(json.dumps(sglang_json(answer)))
    assert body["meta_info"]["routed_experts"] == __import__("base64").b64encode(
        routes.astype("<i4").tobytes()).decode()
    frames = encode_frames(frames_answer(answer))
    decoded = decode_frames(frames)
    results = [GenerateResult.from_json(request, b, num_layers=LAYERS, topk=TOPK, num_experts=200)
               for b in (body, decoded)]
    for r in results:
        assert r.routed_experts.dtype == np.uint8 and np.array_equal(r.routed_experts, routes)
        assert r.output_ids == [7, 8] and r.output_logprobs == [-0.25, -1.5]
        assert "routed_experts" not in r.meta  # one copy of the routes
    # route bytes: 1 per expert slot in frames, 4 x 4/3 in SGLang's base64
    assert len(frames) < len(json.dumps(body))
    assert compact_routes(routes, 300).dtype == np.int16


def test_a_calls_samples_of_one_prompt_send_its_routes_once():
    """A call with samples of two 3-token prompts A, A, B, B, A (a sample's prompt rows equal its prompt's others, as a
    prefill makes them): the frames carry each prompt's rows once, and the decoded answers equal the originals bit for
    bit, as SGLang's JSON (not shared) does."""
    import base64

    from mpo.rollout.frames import restore_prompt_routes

    rng = np.random.default_rng(2)
    prompts = {"A": rng.integers(0, 200, (3, LAYERS, TOPK)), "B": rng.integers(0, 200, (3, LAYERS, TOPK))}
    routes = [np.concatenate([prompts[p], rng.integers(0, 200, (1 + i, LAYERS, TOPK))]) for i, p in enumerate("AABBA")]
    answers = [{**_answer(0, None), "meta_info": {**_answer(0, None)["meta_info"], "prompt_tokens": 3,
                                                  "routed_experts": compact_routes(r, 200)}} for r in routes]
    framed = frames_answer(answers)
    assert [len(a["meta_info"]["routed_experts"]) for a in framed] == [4, 2, 6, 4, 5]
    assert [a["meta_info"].get("routed_experts_prompt_from") for a in framed] == [None, 0, None, 2, 0]
    decoded = restore_prompt_routes(decode_frames(encode_frames(framed)))
    as_json = json.loads(json.dumps(sglang_json(answers)))
    for original, a, j in zip(routes, decoded, as_json):
        assert np.array_equal(a["meta_info"]["routed_experts"], original)
        assert "routed_experts_prompt_from" not in a["meta_info"]
        assert j["meta_info"]["routed_experts"] == base64.b64encode(original.astype("<i4").tobytes()).decode()
    bad = decode_frames(encode_frames(framed))
    bad[1]["meta_info"]["routed_experts_prompt_from"] = 2  # not an earlier answer
    with pytest.raises(ValueError, match="names no earlier answer's prompt routes"):
        restore_prompt_routes(bad)


def test_frames_errors_are_one_line():
    with pytest.raises(ValueError, match="bad magic"):
        decode_frames(b"{}")
    good = encode_frames({"a": np.zeros(4, np.uint8)})
    assert decode_frames(encode_frames(7)) == 7 and decode_frames(encode_frames("x")) == "x"  # a bare scalar payload
    # columns: arrays of one dtype and row shape travel as one (rows sliced back), others apart, 0-d whole
    mixed = {"a": [np.arange(3, dtype=np.int64), np.arange(0, dtype=np.int64), np.arange(5, dtype=np.int64)],
             "r": [np.ones((2, 4, 2), np.uint8), np.zeros((1, 4, 2), np.uint8)], "s": np.array(2.5),
             "b": np.arange(6, dtype=">f4").reshape(2, 3)}
    back = decode_frames(encode_frames(mixed))
    assert [x.tolist() for x in back["a"]] == [[0, 1, 2], [], [0, 1, 2, 3, 4]]
    assert [x.shape for x in back["r"]] == [(2, 4, 2), (1, 4, 2)] and back["r"][0].dtype == np.uint8
    assert back["s"].shape == () and float(back["s"]) == 2.5 and back["b"].tolist() == mixed["b"].tolist()
    body = encode_frames(mixed)
    (length,) = struct.unpack_from("<Q", body, len(MAGIC))
    table = json.loads(body[len(MAGIC) + 8:len(MAGIC) + 8 + length])["arrays"]
    assert [(dtype, shape) for dtype, shape, _, _ in table] == [("int64", [8]), ("uint8", [3, 4, 2]),
                                                                ("float64", []), ("float32", [2, 3])]
    with pytest.raises(ValueError, match="does not fit"):
        decode_frames(good[:-1])
    one = [["uint8", [4], 0, 4]]
    for header, message in (({"payload": {"a": {"__array__": 1}}, "arrays": one}, "names array 1"),
                            ({"payload": {"a": {"__array__": [0, 2, 5]}}, "arrays": one}, "names array"),
                            ({"payload": {"a": {"__array__": [0, 3, 2]}}, "arrays": one}, "names array"),
                            ({"payload": {"a": {"__array__": [0, 1]}}, "arrays": one}, "names array"),
                            ({"payload": {"a": {"__array__": [0, 0, 1.5]}}, "arrays": one}, "names array"),
                            ({"payload": {"a": {"__array__": [0, 0, 0]}}, "arrays": [["uint8", [], 0, 1]]},
                             "names array"),
                            ({"payload": {"a": {"__array__": 0}}, "arrays": [["uint8", 4, 0, 4]]}, "list of sizes"),
                            ({"payload": 1, "arrays": 5}, "frames header is not"), ([1, 2], "frames header is not")):
        text = json.dumps(header).encode()  # a hostile header: a missing array, a shape that is not one
        with pytest.raises(ValueError, match=message):
            decode_frames(MAGIC + struct.pack("<Q", len(text)) + text + bytes(4))
    with pytest.raises(ValueError, match=r"valid: \[0, 16\)"):
        compact_routes(np.array([[[16]]]), 16)
    request = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=2), return_routed_experts=True)
    with pytest.raises(ValueError, match="shape"):
        GenerateResult.from_json(request, decode_frames(encode_frames(frames_answer(
            _answer(4, np.zeros((3, LAYERS, TOPK), np.uint8))))), num_layers=LAYERS, topk=TOPK)


def test_mpo_engine_answers_frames_when_asked_and_json_otherwise():
    """The engine server's reply: frames (uint8 routes, content type) for a client that asks, SGLang's JSON else;
    both decode to the same result."""
    from mpo.engine.generator import MpoGenerator
    from mpo.engine.server import EngineApp, serve
    from mpo.rollout.client import EngineClient
    from mpo.rollout.pool import EngineHandle, PoolConfig, RolloutPool

    def routes(rows: int, positions: range):
        return torch.tensor([[[[(p + l) % EXPERTS, (p + l + 1) % EXPERTS] for l in range(LAYERS)]
                              for p in positions]] * rows, dtype=torch.int32)

    class Model:  # the generator's model (mpo.engine.generator.BatchModel): uniform logits, routes by position
        def prefill(self, ids, *, capacity, want_routes):
            cache = {"next": ids.shape[1]}
            placed = routes(ids.shape[0], range(ids.shape[1])) if want_routes else None
            return cache, torch.zeros(*ids.shape, 32), placed

        def decode(self, cache, ids, *, want_routes):
            position, cache["next"] = cache["next"], cache["next"] + 1
            placed = routes(ids.shape[0], range(position, position + 1)) if want_routes else None
            return torch.zeros(ids.shape[0], 1, 32), placed

        def keep_rows(self, cache, rows):
            pass

    generator = MpoGenerator(Model(), vocab_size=32, num_experts=EXPERTS)
    app = EngineApp(generator, info={"enable_return_routed_experts": True, "context_length": 64})
    server = serve(app, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        client = EngineClient(url, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
        requests = [GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=3, sampling_seed=i),
                                    return_routed_experts=True) for i in range(2)]
        pool = RolloutPool([EngineHandle(client)], PoolConfig(max_concurrency_per_engine=1))
        framed = pool.generate(requests, requests_per_call=2)
        plain = client.call("/generate", {**requests[0].to_json(), "input_ids": [[1, 2, 3]] * 2,
                                          "sampling_params": [r.sampling.to_json() for r in requests]})
        for r, body, req in zip(framed, plain, requests):
            n = len(r.prompt_ids) + len(r.output_ids) - 1
            expected = np.array([[[(p + l) % EXPERTS, (p + l + 1) % EXPERTS] for l in range(LAYERS)]
                                 for p in range(n)])
            assert r.routed_experts.dtype == np.uint8 and np.array_equal(r.routed_experts, expected)
            again = GenerateResult.from_json(req, body, num_layers=LAYERS, topk=TOPK)
            assert isinstance(body["meta_info"]["routed_experts"], str)  # SGLang's base64 for a JSON client
            assert np.array_equal(again.routed_experts, expected) and again.output_ids == r.output_ids
            assert again.output_logprobs == r.output_logprobs
        import httpx

        raw = httpx.post(f"{url}/generate", json=requests[0].to_json(), headers={"Accept": CONTENT_TYPE})
        assert raw.headers["content-type"] == CONTENT_TYPE
    finally:
        server.shutdown()
        generator.stop()


# -- rank 0's version bookkeeping -------------------------------------------------------------------------------------
def test_version_numbers_and_versions_jsonl_summary(tmp_path):
    from mpo.rollout.protocol import token_versions, weight_version
    from mpo.trainer.metrics_log import MetricsLog

    stamps = ["3", "3", "4", "default", "4"]  # as the engine stamps them: str(version), "default" before any update
    assert token_versions(stamps).tolist() == [3, 3, 4, -1, 4]
    assert token_versions(stamps, 9, 5).tolist() == [3, 3, 4, 9, 4]
    assert token_versions(token_versions(stamps), 9).tolist() == [3, 3, 4, 9, 4]  # as collect gets them
    assert token_versions(None, 7, 3).tolist() == token_versions([], 7, 3).tolist() == [7, 7, 7]
    assert token_versions([5, None]).tolist() == [5, -1] and token_versions([]).tolist() == []
    # what a broken or hostile engine might stamp: unknown (-1), never an error or a wrong version
    assert token_versions([[3], {"v": 3}, True, 3.0, -2, "-2", "3"]).tolist() == [-1, -1, -1, -1, -1, -1, 3]
    assert weight_version("step3") is None and weight_version(7) == 7 and weight_version("\u00b2") is None
    versions = [np.array([3, 3, 4, 4, 3]), [5], []]
    for per_token in (False, True):
        out = tmp_path / str(per_token)
        log = MetricsLog(out, tensorboard=False, total_steps=1, progress=False, versions_per_token=per_token)
        log.log_versions(6, versions)
        row = json.loads((out / "versions.jsonl").read_text())
        if per_token:
            assert row == {"step": 6, "versions": [[3, 3, 4, 4, 3], [5], []]}
        else:
            assert row == {"step": 6, "tokens": [5, 1, 0], "min": [3, 5, None], "max": [4, 5, None],
                           "changes": [2, 0, 0]}


def test_staleness_metrics_from_version_arrays():
    """staleness_max / staleness_mean over consumed tokens, a stale sample dropped: against a per-token count."""
    from mpo.trainer.schedule import RolloutSchedule

    batch = [Sample(ids=[1, 2, 3], prompt_len=1, group=0, reward=0.0, versions=np.array([8, 9])),
             Sample(ids=[1, 2, 3, 4], prompt_len=1, group=0, reward=0.0, versions=np.array([10, 10, 9])),
             Sample(ids=[1, 2], prompt_len=1, group=0, reward=0.0, versions=np.array([6]))]
    logged = []
    schedule = RolloutSchedule(lambda step, version: (batch, {}), "async", 2, start=10, steps=11,
                               on_versions=lambda s, v: logged.append(v))
    try:
        samples, metrics = schedule.take(10)
    finally:
        schedule.stop()
    ages = [10 - v for v in (8, 9, 10, 10, 9)]
    assert len(samples) == 2 and metrics["staleness_dropped_samples"] == 1
    assert metrics["staleness_max"] == max(ages) and metrics["staleness_mean"] == pytest.approx(sum(ages) / len(ages))
    assert [list(v) for v in logged[0]] == [[8, 9], [10, 10, 9]]
