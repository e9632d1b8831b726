"""SGLang wire format: routed experts are base64 little-endian int32 [prompt+completion-1, layers, top_k]."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from mpo.rollout.protocol import (GenerateRequest, GenerateResult, SamplingParams, decode_routed_experts,
                                  encode_routed_experts)


def test_routed_experts_round_trip_and_sglang_bytes():
    experts = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2)
    encoded = encode_routed_experts(experts)
    # Independent check of the byte layout: little-endian int32, row-major.
    assert base64.b64decode(encoded)[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert np.array_equal(decode_routed_experts(encoded, rows=5, num_layers=2, topk=2), experts)


def test_routed_experts_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="expected rows=4 x layers=2 x top_k=2"):
        decode_routed_experts(encode_routed_experts(np.zeros((5, 2, 2))), rows=4, num_layers=2, topk=2)


def test_generate_result_parses_sglang_response():
    request = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=2), return_routed_experts=True)
    body = {"text": "", "output_ids": [7, 8], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
        "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]],
        "routed_experts": encode_routed_experts(np.ones((4, 3, 2), dtype=np.int32))}}
    result = GenerateResult.from_json(request, body, num_layers=3, topk=2)
    assert result.output_logprobs == [-0.5, -1.5] and result.weight_version == 3
    assert result.routed_experts.shape == (4, 3, 2) and not result.aborted


def test_missing_routes_say_how_to_enable_them():
    request = GenerateRequest((1, 2), return_routed_experts=True)
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        GenerateResult.from_json(request, {"output_ids": [3], "meta_info": {"output_token_logprobs": [[0, 3, None]]}},
                                 num_layers=1, topk=1)


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("max_new_tokens", 0)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingParams(**{field: value})


def test_two_event_loops_share_an_engine_client_without_closing_each_others_connections():
    """An async producer's batch and an evaluation run RolloutPool.generate on one EngineClient at the same time, each
    in its own asyncio loop on its own thread, and each closes its client when done. A real HTTP server on loopback
    answers /slow after 1 s: the other loop's call and close in the meantime must not cut the slow call (with one
    async client shared by every loop it failed with httpx.ReadError: 'async producer + eval' in the demo)."""
    import asyncio
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mpo.rollout.client import EngineClient

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/slow":
                time.sleep(1.0)
            body = json.dumps({"path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = EngineClient(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=10)
    slow: dict = {}

    async def call_and_close(endpoint: str) -> dict:
        try:
            return await client.acall(endpoint, {})
        finally:
            await client.aclose()

    def run_slow():
        try:
            slow["reply"] = asyncio.run(call_and_close("/slow"))
        except Exception as exc:  # noqa: BLE001 - reported below
            slow["error"] = exc

    try:
        thread = threading.Thread(target=run_slow)
        thread.start()
        time.sleep(0.3)  # the slow call is in flight
        assert asyncio.run(call_and_close("/fast")) == {"path": "/fast"}
        thread.join(timeout=10)
        assert slow == {"reply": {"path": "/slow"}}, slow
    finally:
        server.shutdown()


class _FakeEngine:
    """An EngineClient stand-in: answers every request with its own prompt's first id; `dies` after its first call."""

    def __init__(self, url: str, dies: bool = False) -> None:
        self.url, self.dies, self.calls = url, dies, 0

    async def generate_batch(self, requests, *, timeout_s=None):
        from mpo.rollout.client import EngineError

        self.calls += 1
        if self.dies:
            raise EngineError(self.url, "/generate", "connection refused", retryable=True)
        return [GenerateResult(list(q.input_ids), [q.input_ids[0]], [0.0], {"type": "stop"}) for q in requests]

    def healthy(self, timeout_s=30.0) -> bool:
        return not self.dies

    async def aclose(self) -> None:
        pass


def test_a_restarted_engine_takes_no_work_until_it_is_current():
    """mpo.rollout.engines: a restarted engine is stale until a weight sync reaches it. The pool gives a stale engine
    no work (the others take its share); with none current left it raises StaleEngines naming the engine."""
    from mpo.rollout.pool import EngineHandle, PoolConfig, RolloutPool, StaleEngines

    requests = [GenerateRequest((i + 1, 0)) for i in range(6)]
    stale = _FakeEngine("http://stale")
    fresh = _FakeEngine("http://fresh")
    pool = RolloutPool([EngineHandle(stale, current=lambda: False), EngineHandle(fresh, current=lambda: True)])
    assert [r.output_ids for r in pool.generate(requests)] == [[i + 1] for i in range(6)]
    assert stale.calls == 0 and fresh.calls == 6
    current = [True]
    victim = _FakeEngine("http://victim", dies=True)

    def restart() -> None:  # as EngineSet._restart: back up, but stale
        victim.dies, current[0] = False, False

    pool = RolloutPool([EngineHandle(victim, restart=restart, current=lambda: current[0])],
                       PoolConfig(backoff_s=0, max_concurrency_per_engine=1))
    with pytest.raises(StaleEngines, match="restarted, waiting for the next weight sync: http://victim"):
        pool.generate(requests)
    assert victim.calls == 1
    current[0] = True  # the next weight sync reached it
    assert [r.output_ids for r in pool.generate(requests)] == [[i + 1] for i in range(6)]
