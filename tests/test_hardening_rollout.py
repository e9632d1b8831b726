"""Issue 47, items 2 and 7 (part): a malformed engine answer, or any other error in the rollout pool, ends the
rollout promptly (retried as an engine failure, or one line) and never leaves a dead worker that the others wait for
forever; an engine failure ends a trainer rank in one line; a stopped rollout producer is warned about and ends the
run in one line after rollout.request_timeout_s of silence; an engine URL without a scheme is a one-line config error.

Real: the engines are HTTP servers on 127.0.0.1 (http.server) that speak enough of SGLang's /generate and
/health_generate to answer malformed bodies; the producer is a real spawned child process, stopped with a real SIGSTOP;
the config error goes through `mpo check-config`'s main(argv). Faked, and said where: one test replaces a client's
generate_batch with one that raises (a bug in the client, which no server can provoke); the trainer-rank test
replaces mpo.trainer.loop.run (a whole RL run) with the rollout step that meets the failure, then runs the rank's
real entry point (mpo.trainer.__main__.main) in a fresh interpreter. A regression that hangs fails within its bound
(each rollout runs on a thread joined with a timeout) instead of hanging the suite.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from mpo.rollout.client import EngineClient, EngineError
from mpo.rollout.frames import CONTENT_TYPE as FRAMES, MAGIC, encode_frames
from mpo.rollout.pool import EngineHandle, PoolConfig, RolloutFailed, RolloutPool, rollout_failure
from mpo.rollout.protocol import GenerateRequest, GenerateResult, SamplingParams

BOUND_S = 10.0  # a rollout that meets a malformed answer must end (return or raise) within this
RECIPE = Path(__file__).resolve().parents[1] / "mpo" / "recipes" / "demo_cpu.yaml"
REQUESTS = [GenerateRequest((i + 1, 2), SamplingParams(max_new_tokens=1)) for i in range(4)]


GOOD = {"text": "", "output_ids": [7], "meta_info": {  # a well-formed SGLang answer: token 7, its log-prob
    "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None]], "e2e_latency": 0.01}}


class _Engine:
    """An HTTP server on 127.0.0.1 answering every /generate with `answer` ((status,) body, content type; None: a
    well-formed answer, GOOD per row) and /health_generate with 200 (or 503 when not `healthy`); counts the /generate
    calls."""

    def __init__(self, answer: tuple | None, *, healthy: bool = True) -> None:
        engine = self
        self.answer, self.healthy, self.calls = answer, healthy, 0

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's name
                self._send(200 if engine.healthy else 503, b"{}", "application/json")

            def do_POST(self):  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.calls += 1
                if engine.answer is None:
                    rows = request["input_ids"]
                    good = [GOOD] * len(rows) if isinstance(rows[0], list) else GOOD
                    status, body, kind = 200, json.dumps(good).encode(), "application/json"
                else:
                    status, body, kind = engine.answer if len(engine.answer) == 3 else (200, *engine.answer)
                self._send(status, body, kind)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _bounded(fn, bound_s: float = BOUND_S):
    """fn() on a thread: (its result or None, its exception or None, seconds); fails the test if it is still
    running after `bound_s` (a hung rollout: the thread is left behind as a daemon)."""
    out: dict = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"still running after {bound_s:.0f} s: a dead worker left the others waiting"
    return out.get("result"), out.get("error"), time.monotonic() - started


def _frames(header: bytes) -> bytes:
    return MAGIC + struct.pack("<Q", len(header)) + header


DEEP = 100_000  # nesting levels: past any recursion limit
MALFORMED = {  # name: ((status,) body, content type) of a /generate answer to a batch of 2
    "deep-json": (b"[" * DEEP + b"]" * DEEP, "application/json"),
    "deep-json-error-body": (500, b'{"message": ' + b"[" * DEEP + b"]" * DEEP + b"}", "application/json"),
    "traceback-error-body": (500, b'Traceback (most recent call last):\n  File "x.py", line 1\nKeyError: 7\n',
                             "text/plain"),
    "meta-info-a-list": (json.dumps([{"output_ids": [7], "meta_info": [1]}] * 2).encode(), "application/json"),
    "output-ids-a-number": (json.dumps([{"output_ids": 7, "meta_info": {}}] * 2).encode(), "application/json"),
    "empty-logprob-triple": (json.dumps([{"output_ids": [7], "meta_info": {"output_token_logprobs": [[]]}}] * 2)
                             .encode(), "application/json"),
    "finish-reason-a-string": (json.dumps([{"output_ids": [7], "meta_info": {
        "output_token_logprobs": [[-0.5, 7, None]], "finish_reason": "stop"}}] * 2).encode(), "application/json"),
    "frames-deep-header": (_frames(b'{"payload": ' + b"[" * DEEP + b"]" * DEEP + b', "arrays": []}'), FRAMES),
    "frames-routes-from-a-number": (encode_frames([5, {"output_ids": np.array([7]), "meta_info": {
        "routed_experts_prompt_from": 0, "prompt_tokens": 1, "routed_experts": np.zeros((1, 1, 1), np.uint8)}}]),
        FRAMES),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_hardening_rollout_malformed_answer_is_a_retried_engine_failure_not_a_hang(case):
    """Each malformed answer (before the fix: RecursionError, AttributeError, TypeError or IndexError in a pool
    worker, which died with its call while the other workers waited forever; an error page of many lines kept them)
    is an EngineError naming the engine: retried like a 5xx up to max_attempts, then the rollout fails in one line,
    well within the bound."""
    engine = _Engine(MALFORMED[case])
    pool = RolloutPool([EngineHandle(EngineClient(engine.url, timeout_s=5))],
                       PoolConfig(max_attempts=2, backoff_s=0, max_concurrency_per_engine=2))
    try:
        _, error, _ = _bounded(lambda: pool.generate(REQUESTS[:2], requests_per_call=2))
    finally:
        engine.close()
    assert isinstance(error, EngineError), repr(error)
    message = str(error)
    assert "\n" not in message and len(message) < 800, message
    assert message.startswith(f"engine {engine.url}: /generate failed: gave up after 2 attempts: "), message
    assert any(why in message for why in ("bad response", "bad frames body", "HTTP 500: ")), message
    assert engine.calls == 2  # retried once, as an engine failure


def test_hardening_rollout_a_malformed_engine_loses_its_work_to_a_good_one():
    """One engine answers wrong types, the other well: the bad engine's calls are retried on the good one and the
    rollout completes, every request answered once."""
    bad = _Engine(MALFORMED["meta-info-a-list"])
    good = _Engine(None)
    pool = RolloutPool([EngineHandle(EngineClient(bad.url, timeout_s=5)), EngineHandle(EngineClient(good.url))],
                       PoolConfig(max_attempts=4, backoff_s=0, max_concurrency_per_engine=1))
    try:
        results, error, _ = _bounded(lambda: pool.generate(REQUESTS, requests_per_call=2))
    finally:
        bad.close()
        good.close()
    assert error is None, repr(error)
    assert [r.output_ids for r in results] == [[7]] * 4
    assert bad.calls >= 1 and {r.url for r in pool.resent} == {bad.url}


def test_hardening_rollout_unexpected_error_in_a_worker_ends_the_rollout_in_one_line(monkeypatch):
    """Faked: the client's generate_batch raises a RuntimeError (a bug: no answer provokes it). Before the fix its
    worker died and the rollout hung; now the pool stops every worker and raises RolloutFailed naming the engine,
    the error and where it was raised."""
    engine = _Engine(None)
    client = EngineClient(engine.url)

    async def broken(requests, *, timeout_s=None):
        raise RuntimeError("a bug in the client")

    monkeypatch.setattr(client, "generate_batch", broken)
    pool = RolloutPool([EngineHandle(client)], PoolConfig(backoff_s=0, max_concurrency_per_engine=3))
    try:
        _, error, _ = _bounded(lambda: pool.generate(REQUESTS, requests_per_call=1))
    finally:
        engine.close()
    assert isinstance(error, RolloutFailed), repr(error)
    assert str(error) == (f"rollout: RuntimeError at {Path(__file__).name}:"
                          f"{broken.__code__.co_firstlineno + 1} with engine {engine.url}: a bug in the client")
    assert rollout_failure(RuntimeError("outer")) is None and rollout_failure(error) is error


def test_hardening_rollout_engine_whose_restart_raises_is_given_up_not_a_hang():
    """A down engine (503 to /generate and to health checks) whose restart raises, beside a good one: before the fix
    the exception escaped the worker recovering it, leaving the engine marked not ready, and its other workers
    waited for it forever (the rollout never returned). Now the failed restart is logged, the engine is given up on
    (restarted once, not once per worker) and the good engine takes its calls."""
    down = _Engine((503, b'{"message": "overloaded"}', "application/json"), healthy=False)
    good = _Engine(None)
    restarts = []

    def restart() -> None:
        restarts.append(1)
        raise RuntimeError("the engine's process failed to start")

    pool = RolloutPool([EngineHandle(EngineClient(down.url), restart=restart), EngineHandle(EngineClient(good.url))],
                       PoolConfig(backoff_s=0, max_concurrency_per_engine=2))
    try:
        results, error, _ = _bounded(lambda: pool.generate(REQUESTS, requests_per_call=1))
    finally:
        down.close()
        good.close()
    assert error is None, repr(error)
    assert [r.output_ids for r in results] == [[7]] * 4
    assert restarts == [1] and down.calls >= 1


@pytest.mark.parametrize("field, answer", [
    ("the answer", [1]),
    ("meta_info", {"meta_info": "x"}),
    ("output_ids", {"output_ids": "7"}),
    ("output_ids[0]", {"output_ids": [True]}),
    ("output_ids[0]", {"output_ids": [-1]}),
    ("output_ids", {"output_ids": np.array([[7]])}),
    ("meta_info.output_token_logprobs", {"output_ids": [7], "meta_info": {"output_token_logprobs": 3}}),
    ("meta_info.output_token_logprobs[0]", {"output_ids": [7], "meta_info": {"output_token_logprobs": [5]}}),
    ("meta_info.output_token_logprobs[0]", {"output_ids": [7], "meta_info": {"output_token_logprobs": [["x"]]}}),
    ("meta_info.output_token_logprobs", {"output_ids": np.array([7]),
                                         "meta_info": {"output_token_logprobs": np.array([1], np.int64)}}),
    ("meta_info.finish_reason", {"output_ids": [], "meta_info": {"finish_reason": ["stop"]}}),
    ("meta_info.e2e_latency", {"output_ids": [], "meta_info": {"e2e_latency": "1s"}}),
    ("meta_info.output_token_weight_versions", {"output_ids": [], "meta_info": {"output_token_weight_versions": 3}}),
    ("output_token_weight_versions has 2", {"output_ids": [7], "meta_info": {
        "output_token_logprobs": [[-1.0, 7, None]], "output_token_weight_versions": [1, 1]}}),
    ("meta_info.routed_experts", {"output_ids": [7], "meta_info": {"output_token_logprobs": [[-1.0, 7, None]],
                                                                    "routed_experts": 5}}),
    ("routed_experts has shape", {"output_ids": [7], "meta_info": {  # floats: shape right, dtype not
        "output_token_logprobs": [[-1.0, 7, None]], "routed_experts": np.zeros((2, 1, 1), np.float32)}}),
])
def test_hardening_rollout_every_field_read_from_an_answer_is_type_checked(field, answer):
    """GenerateResult.from_json reads an engine's answer: every field of the wrong type or size is a ValueError
    naming it (the client makes it an engine failure), not an AttributeError, TypeError or IndexError later."""
    routes = "routed_experts" in str(answer)
    request = GenerateRequest((1, 2), return_routed_experts=routes)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        GenerateResult.from_json(request, answer, num_layers=1, topk=1, num_experts=4)


def test_hardening_rollout_an_engines_meta_info_cannot_set_the_loss_mask():
    """meta.loss_mask is mpo's own (multi-turn episodes build it, and the trainer weights the loss by it): an
    engine's meta_info.loss_mask is dropped, not trained on."""
    result = GenerateResult.from_json(GenerateRequest((1, 2)), {"output_ids": [7], "meta_info": {
        "output_token_logprobs": [[-1.0, 7, None]], "loss_mask": "all"}})
    assert "loss_mask" not in result.meta and result.output_ids == [7]


_RANK = textwrap.dedent('''
    import sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"message": "input_ids[0]=5 is outside the vocabulary [0, 4)"}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def rollout_step(config):  # the part of a run that meets the engine's refusal
        from mpo.rollout.client import EngineClient
        from mpo.rollout.protocol import GenerateRequest
        if sys.argv[1] == "sync":  # rank 0's own pool (mpo.trainer.collect)
            from mpo.rollout.pool import EngineHandle, RolloutPool
            RolloutPool([EngineHandle(EngineClient(url))]).generate([GenerateRequest((5, 1))])
        else:  # the off-policy producer process, through the schedule's producer thread, as in a run
            from mpo.trainer.producer import ProducerProcess
            from mpo.trainer.schedule import RolloutSchedule
            client = EngineClient(url, num_layers=2, topk=2)  # the routes are asked for (rollout.engine=mpo)
            producer = ProducerProcess(config, [(client, None, None)], context_length=64)
            try:
                RolloutSchedule(producer.collect, "async", 1, 0, 1).take(0)
            finally:
                producer.close()

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            # The producer abandons its other calls in flight once one is refused (the run ends): this stand-in's
            # writes to them then fail (BrokenPipe) and socketserver would print a traceback of its own, which is
            # not mpo's output; the assertion below is about mpo's.
            pass

    if __name__ == "__main__":  # (the producer's spawned child imports this file too)
        server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        print(url, flush=True)

        import mpo.trainer.loop
        from mpo.trainer.__main__ import main

        mpo.trainer.loop.run = rollout_step
        sys.exit(main(["schedule.mode=" + sys.argv[1]]))
''')


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_hardening_rollout_engine_error_ends_the_trainer_rank_in_one_line(mode, tmp_path):
    """An engine that refuses a request (HTTP 400: not retryable) ends a trainer rank with one line naming the engine
    and its message, exit code 3 (mpo.torchrun prints that line once for the job), no traceback: in sync mode
    (rank 0's pool) and off-policy (the producer child's pool; the error crosses the process boundary). Faked: the
    run is only the rollout step (mpo.trainer.loop.run replaced); the entry point and everything under it are real."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=180, env=env,
                          cwd=root)
    url = done.stdout.strip()
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    mpo_lines = [line for line in done.stderr.splitlines() if line.startswith("mpo")]
    assert mpo_lines == [f"mpo: engine {url}: /generate returned HTTP 400: input_ids[0]=5 is outside the vocabulary "
                         "[0, 4)"], done.stderr[-3000:]


def test_hardening_rollout_stopped_producer_warns_then_ends_in_one_line(caplog):
    """A producer process stopped with SIGSTOP (alive, silent): before the fix rank 0 waited for its answer forever,
    without a word. Now rank 0 warns while it waits and, after rollout.request_timeout_s of silence (2 s here), kills
    it and the call raises ProducerDied in one line saying so."""
    from mpo.config_checks import load_config
    from mpo.trainer.producer import ProducerDied, ProducerProcess

    config = load_config(None, ["schedule.mode=async", "rollout.request_timeout_s=2"])
    producer = ProducerProcess(config, [(EngineClient("http://127.0.0.1:9"), None, None)], context_length=64)
    try:
        producer.state_dict()  # up and answering
        os.kill(producer.pid, signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="mpo.trainer.producer"):
            _, error, seconds = _bounded(producer.state_dict)
        assert isinstance(error, ProducerDied), repr(error)
        assert 1.5 <= seconds < 6.0
        assert re.fullmatch(rf"the rollout producer process \(pid {producer.pid}\) sent nothing for \d+ s \(stopped "
                            r"or hung; rollout.request_timeout_s=2\) and was killed", str(error)), str(error)
        warnings = [r.getMessage() for r in caplog.records if "has sent nothing for" in r.getMessage()]
        assert warnings and all(f"(pid {producer.pid})" in w for w in warnings), caplog.text
        producer.process.join(5)
        assert producer.process.exitcode == -signal.SIGKILL
    finally:
        if producer.process.is_alive():
            os.kill(producer.pid, signal.SIGCONT)
        producer.close()


def test_hardening_rollout_engine_url_without_a_scheme_is_one_line(capsys):
    """`mpo check-config` refuses rollout.urls=[localhost:30000] (before: accepted, and `mpo train` ended in a
    traceback at its first request) in one line naming the field and the value, exit 2."""
    from mpo.cli import main

    for bad in ("localhost:30000", "http://:30000", "ftp://engine:30000", "http://engine:port"):
        capsys.readouterr()
        code = main(["check-config", "--config", str(RECIPE), f"rollout.urls=[{bad}]"])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and "Traceback" not in err and len(lines) == 1, err
        assert lines[0] == (f"mpo: config error: rollout.urls[0]='{bad}'; valid values: 'http://host:port' or "
                            "'https://host:port'"), lines
    capsys.readouterr()
    assert main(["check-config", "--config", str(RECIPE), "rollout.urls=[http://engine:30000,https://e2]"]) == 0
