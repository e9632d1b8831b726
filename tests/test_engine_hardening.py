"""mpo's engine server: one bad request harms no one (issue 12, items 6-11 and 13).

One real engine process (real HTTP on loopback) with small limits serves the module, so each limit is reached in
seconds: bodies are refused from their headers (401/413 before reading), idle connections time out, connection
threads are bounded, every /generate field is validated (400 naming it), a bad request never aborts a concurrent
one, max_new_tokens is capped by the context length, a burst of parallel clients is not reset, and joining a
weight-update group at a dead address fails within its bound while other routes answer. sglang_wire's pickling
leaves the process's stdio and descriptors alone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
import torch

from mpo.parallel.ports import free_port
from mpo.rollout.client import EngineClient, EngineError
from mpo.rollout.local_engine import LocalEngineProcess
from mpo.engine.generator import MpoGenerator
from mpo.rollout.protocol import GenerateRequest, SamplingParams

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDLE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 48
GROUP_INIT_TIMEOUT_S = 3.0
HEADER_TIMEOUT_S = 1.0
MAX_ROWS = 64
CONTEXT_LENGTH = 512  # the tiny preset's max_position_embeddings


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    process = LocalEngineProcess.mpo_engine(
        log_path=tmp_path_factory.mktemp("hardening") / "engine.log", api_key=KEY,
        extra_args=["--max-body-mb", "1", "--idle-timeout-s", str(IDLE_TIMEOUT_S), "--max-connections",
                    str(MAX_CONNECTIONS), "--group-init-timeout-s", str(GROUP_INIT_TIMEOUT_S),
                    "--header-timeout-s", str(HEADER_TIMEOUT_S), "--max-rows-per-request", str(MAX_ROWS)]).start()
    yield process
    process.stop()


def _proc_status(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _raw_exchange(port: int, head: str, *, timeout_s: float = 10.0) -> bytes:
    """Send request headers only (no body) on a fresh connection; return what the server answers before closing
    or going quiet for timeout_s."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head.encode())
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and b'"message"' in b"".join(chunks):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return b"".join(chunks)


def _post(engine, path: str, body, *, timeout_s: float = 30.0) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{engine.url}{path}", content=content, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=timeout_s)


# -- item 6: authenticate first, cap bodies, time out idle connections, bound threads ------------------------------
def test_hardening_huge_declared_body_is_refused_from_the_headers(engine):
    """Content-Length: 8 GB: 401 without a key and 413 with one, answered at once without reading (nor allocating)
    the body; the engine's virtual size does not grow by anything near it."""
    pid = engine.process.pid
    before = _proc_status(pid, "VmSize")
    head = "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 8000000000\r\n"
    started = time.monotonic()
    no_key = _raw_exchange(engine.port, head + "\r\n")
    assert no_key.startswith(b"HTTP/1.1 401"), no_key[:200]
    with_key = _raw_exchange(engine.port, head + f"Authorization: Bearer {KEY}\r\n\r\n")
    assert with_key.startswith(b"HTTP/1.1 413"), with_key[:200]
    assert b"--max-body-mb" in with_key
    # A client that asks before sending ("Expect: 100-continue") is told no, not invited to send 8 GB.
    asked = _raw_exchange(engine.port, head + "Expect: 100-continue\r\n\r\n")
    assert asked.startswith(b"HTTP/1.1 401"), asked[:200]
    assert time.monotonic() - started < 10.0
    grown_kb = _proc_status(pid, "VmSize") - before
    assert grown_kb < 512 << 10, f"engine grew by {grown_kb} kB of virtual memory"
    # A body just over the limit, really sent, gets the same answer through a normal client.
    response = _post(engine, "/generate", b"x" * ((1 << 20) + 1))
    assert response.status_code == 413


def test_hardening_idle_connections_time_out_and_threads_are_bounded(engine):
    """Connections that send nothing get no thread and are closed (408) after --header-timeout-s. Twice
    --max-connections kept-alive clients after one authorized request each: the engine's threads stay bounded (the
    excess is answered 503 at once), every kept-alive connection is closed after --idle-timeout-s, and then the
    engine serves normally."""
    pid = engine.process.pid
    baseline = _proc_status(pid, "Threads")

    def read_all(sock: socket.socket) -> bytes:  # until the server closes it
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data

    silent = [socket.create_connection(("127.0.0.1", engine.port), timeout=30) for _ in range(2 * MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        assert _proc_status(pid, "Threads") <= baseline + 2, "silent connections were given threads"
        started = time.monotonic()
        answers = [read_all(sock) for sock in silent]
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 5.0
        assert all(a.startswith(b"HTTP/1.1 408") and b"--header-timeout-s" in a for a in answers), answers[:2]
    finally:
        for sock in silent:
            sock.close()
    kept = [socket.create_connection(("127.0.0.1", engine.port), timeout=30) for _ in range(2 * MAX_CONNECTIONS)]
    try:
        first = []
        for sock in kept:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
            head = b""
            while b'"status": "ok"}' not in head and b'"message"' not in head:
                head += sock.recv(65536)
            first.append(head)
        peak = _proc_status(pid, "Threads")
        assert peak <= baseline + MAX_CONNECTIONS + 4, f"{peak} threads for {len(kept)} kept-alive connections " \
                                                       f"(baseline {baseline}, limit {MAX_CONNECTIONS})"
        served = sum(h.startswith(b"HTTP/1.1 200") for h in first)  # a slot of an earlier test may be closing
        assert MAX_CONNECTIONS - 4 <= served <= MAX_CONNECTIONS, served
        assert sum(h.startswith(b"HTTP/1.1 503") for h in first) == len(kept) - served
        started = time.monotonic()
        for sock in kept:
            read_all(sock)
        waited = time.monotonic() - started
        assert waited < IDLE_TIMEOUT_S + 20.0, f"idle connections were held {waited:.1f} s"
    finally:
        for sock in kept:
            sock.close()
    assert httpx.get(f"{engine.url}/health", headers=AUTH, timeout=10).status_code == 200


# -- item 7: validate sampling parameters, isolate failures per request ------------------------------------------
def test_hardening_bad_temperature_is_refused_alone_and_a_concurrent_request_finishes(engine):
    """While a greedy request A is queued, temperature NaN is refused (400 naming temperature) and a tiny positive
    temperature (1e-320, below SGLang's 1e-6 greedy threshold) samples greedily; A finishes normally."""
    client = engine.client
    prompt = [1, 2, 3, 4, 5]
    greedy = {"temperature": 0, "max_new_tokens": 6}
    results: dict[str, httpx.Response] = {}

    def send(name: str, params: dict) -> None:
        results[name] = _post(engine, "/generate", {"input_ids": prompt, "sampling_params": params})

    client.pause_generation(mode="in_place")  # queue A and the others together, so they share decode steps
    try:
        threads = [threading.Thread(target=send, args=(name, params)) for name, params in (
            ("A", greedy), ("nan", {**greedy, "temperature": float("nan")}),
            ("tiny", {**greedy, "temperature": 1e-320}))]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
    finally:
        client.continue_generation()
    for thread in threads:
        thread.join(60)
    assert results["nan"].status_code == 400
    assert "sampling_params.temperature=nan" in results["nan"].json()["message"]
    a, tiny = results["A"].json(), results["tiny"].json()
    assert a["meta_info"]["finish_reason"]["type"] == "length", a["meta_info"]["finish_reason"]
    assert tiny["meta_info"]["finish_reason"]["type"] == "length"
    assert tiny["output_ids"] == a["output_ids"]


POISON = 7  # the fake model below gives NaN logits for rows holding this token, and fails its forward on POISON + 1


class _FakeModel:
    """The generator's model interface (mpo.engine.generator.BatchModel) over a fake: token 3 is always likeliest;
    the cache is the rows' tokens so far."""

    @staticmethod
    def _logits(rows: list[list[int]], n: int) -> torch.Tensor:
        if any(POISON + 1 in row for row in rows):
            raise RuntimeError("the forward failed")
        logits = torch.zeros(len(rows), n, 16)
        logits[..., 3] = 5.0
        logits[torch.tensor([POISON in row for row in rows])] = float("nan")
        return logits

    def prefill(self, ids, *, capacity, want_routes):
        cache = ids.tolist()
        return cache, self._logits(cache, ids.shape[1]), None

    def decode(self, cache, ids, *, want_routes):
        for row, token in zip(cache, ids.tolist()):
            row.append(token)
        return self._logits(cache, 1), None

    def keep_rows(self, cache, rows):
        cache[:] = [cache[i] for i in rows]


@pytest.mark.parametrize("poison", [POISON, POISON + 1], ids=["hardening-nan", "hardening-forward"])
def test_hardening_a_failing_row_aborts_only_its_own_request(poison):
    """The generator isolates failures: a row whose logits are NaN, or whose presence makes the batch's forward
    raise, is aborted alone; the request batched with it finishes. The model is faked: the real one cannot be made
    to fail for one row."""
    generator = MpoGenerator(_FakeModel(), vocab_size=16, max_batch=4)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=3, sampling_seed=1)
        good, bad = generator.submit_many([[1, 2], [1, poison]], [params, params], timeout_s=30)
        assert good["meta_info"]["finish_reason"]["type"] == "length" and good["output_ids"] == [3, 3, 3]
        assert bad["meta_info"]["finish_reason"]["type"] == "abort"
        assert "engine error" in bad["meta_info"]["finish_reason"]["message"]
        # The scheduler lives on.
        again = generator.submit([1, 2], params, timeout_s=30)
        assert again["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        generator.stop()


# -- item 8: max_new_tokens capped by the context length -----------------------------------------------------------
def test_hardening_max_new_tokens_is_capped_by_the_context_length(engine):
    started = time.monotonic()
    response = _post(engine, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 10**9}},
                     timeout_s=15)
    assert response.status_code == 400
    message = response.json()["message"]
    assert "max_new_tokens=1000000000" in message and str(CONTEXT_LENGTH - 3) in message, message
    assert time.monotonic() - started < 15
    assert engine.client.server_info()["context_length"] == CONTEXT_LENGTH


# -- item 9: wrong types are 400 with a message naming the field ---------------------------------------------------
BAD_BODIES = [
    ({"input_ids": ["5"]}, "input_ids[0]"),
    ({"input_ids": [5], "sampling_params": "x"}, "sampling_params"),
    ({"input_ids": [5.7]}, "input_ids[0]"),
    ({"input_ids": [True]}, "input_ids[0]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
    ({"input_ids": 5}, "input_ids"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [5], "sampling_params": {"top_p": "0.5"}}, "top_p"),
    ({"input_ids": [5], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [5], "sampling_params": {"sampling_seed": 1.5}}, "sampling_seed"),
    ({"input_ids": [5], "sampling_params": {"stop_token_ids": ["a"]}}, "stop_token_ids"),
    ({"input_ids": [[5], [6]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [5], "rid": 3}, "rid"),
    ({"input_ids": [5], "return_routed_experts": "yes"}, "return_routed_experts"),
    ({"input_ids": [5, 99999]}, "input_ids[1]"),
    ({"text": "hello"}, "input_ids"),
    ([5], "JSON object"),
    ("{not json", "not JSON"),
]


@pytest.mark.parametrize("body, field", BAD_BODIES, ids=[f"hardening-{i}" for i in range(len(BAD_BODIES))])
def test_hardening_wrong_types_get_400_naming_the_field(engine, body, field):
    response = _post(engine, "/generate", body if isinstance(body, str) else json.dumps(body))
    assert response.status_code == 400, (response.status_code, response.text[:300])
    message = response.json()["message"]
    assert field in message and "Traceback" not in message, message


def test_hardening_client_refuses_a_bad_request_before_sending(engine):
    """mpo's client runs the engine's validator: a float token id fails in the caller, naming the field."""
    client = EngineClient(engine.url, api_key=KEY)
    import asyncio

    with pytest.raises(EngineError, match=r"not sent: input_ids\[1\]=2\.5"):
        asyncio.run(client.generate(GenerateRequest((1, 2.5))))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sampling.temperature=nan"):
        SamplingParams(temperature=float("nan"))


# -- item 10: the listen backlog covers a burst of parallel clients ------------------------------------------------
def test_hardening_a_burst_of_connections_waits_in_the_backlog_and_is_served(engine):
    """40 clients connect while the engine is not accepting for a moment (stopped with SIGSTOP, as a long GIL hold
    or a GC pause would): the kernel must queue all of them (a backlog of 5 drops the rest, whose connects time
    out), and once the engine runs again every one gets its /health answered."""
    clients = 40
    barrier = threading.Barrier(clients)
    connected: list[socket.socket] = []
    failures: list[str] = []
    lock = threading.Lock()

    def connect() -> None:
        barrier.wait()
        try:
            sock = socket.create_connection(("127.0.0.1", engine.port), timeout=3.0)
        except OSError as exc:
            with lock:
                failures.append(f"connect: {type(exc).__name__}: {exc}")
            return
        with lock:
            connected.append(sock)

    os.kill(engine.process.pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=connect) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        os.kill(engine.process.pid, signal.SIGCONT)
    statuses = []
    for sock in connected:
        with sock:
            sock.settimeout(30)
            try:
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                             f"Connection: close\r\n\r\n".encode())
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
                statuses.append(data.split(b"\r\n", 1)[0].decode())
            except OSError as exc:
                failures.append(f"request: {type(exc).__name__}: {exc}")
    assert not failures and statuses == ["HTTP/1.1 200 OK"] * clients, (len(failures), failures[:3], statuses[:3])


# -- item 11: a bounded weight-update group join that blocks no one --------------------------------------------
def test_hardening_group_init_at_a_dead_address_is_bounded_and_other_routes_answer(engine):
    """Two joins at addresses where nobody listens fail (400, naming the bound) within about the configured
    --group-init-timeout-s, concurrently rather than one queued behind the other; /health answers all along."""
    results: dict[str, tuple[httpx.Response | Exception, float]] = {}

    def join(name: str) -> None:
        started = time.monotonic()
        try:
            response = _post(engine, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                "group_name": name, "backend": "gloo"}, timeout_s=60)
        except httpx.HTTPError as exc:
            response = exc
        results[name] = (response, time.monotonic() - started)

    threads = [threading.Thread(target=join, args=(name,)) for name in ("dead-1", "dead-2")]
    for thread in threads:
        thread.start()
    health_latencies = []
    while any(t.is_alive() for t in threads):
        started = time.monotonic()
        assert httpx.get(f"{engine.url}/health", headers=AUTH, timeout=10).status_code == 200
        health_latencies.append(time.monotonic() - started)
        time.sleep(0.2)
    bound = 3 * GROUP_INIT_TIMEOUT_S + 10.0  # connect timeout + torch's retry delay, on a loaded box
    for name, (response, elapsed) in results.items():
        assert isinstance(response, httpx.Response), f"{name}: {response!r}"
        assert response.status_code == 400 and "--group-init-timeout-s" in response.json()["message"], response.text
        assert elapsed < bound, f"{name} took {elapsed:.1f} s (bound {bound} s)"
    assert health_latencies and max(health_latencies) < 5.0, health_latencies


# -- item 13: sglang_wire pickling has no process-wide side effects ------------------------------------------------
_WIRE_PROBE = textwrap.dedent("""
    import json, os, pickle, base64, sys, types
    import torch
    import megatron.core  # as in the trainer: it replaces torch.storage._load_from_bytes
    from mpo.weight_sync.wire import flatten_bucket, serialize_for_sglang

    r, w = os.pipe()
    os.set_inheritable(w, True)  # like a multiprocessing child's sentinel pipe

    def state():
        return [os.fstat(1).st_ino, os.fstat(2).st_ino, os.get_inheritable(w),
                torch.multiprocessing.get_sharing_strategy()]

    seen = []

    class Probe:  # records the process state while the pickler runs
        def __reduce__(self):
            seen.append(state())
            return (types.SimpleNamespace, ())

    before = state()
    bucket = flatten_bucket([("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4))])
    payload = serialize_for_sglang({**bucket, "probe": Probe()})
    print(json.dumps({"before": before, "during": seen, "after": state(), "payload": payload}))
""")


# The globals sglang 0.5.23's SafeUnpickler admits that a CPU bucket needs (its ALLOWED_GLOBALS, plus
# torch.storage._load_from_bytes, which it maps to a weights_only load); any other global crashes its scheduler.
SGLANG_ADMITTED = {("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
                   ("collections", "OrderedDict"), ("types", "SimpleNamespace"), ("torch", "Size"),
                   ("torch", "float32")}


def _pickle_globals(data: bytes) -> set[tuple[str, str]]:
    import pickletools

    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        if isinstance(arg, str):
            strings.append(arg)
    return found


def test_hardening_sglang_wire_pickling_leaves_stdio_and_descriptors_alone(tmp_path):
    """Serializing a bucket (megatron imported, as in the trainer) neither redirects stdout/stderr, nor changes a
    descriptor's inheritance, nor the sharing strategy (observed from inside the pickler); the payload names only
    globals sglang admits, and unpickles in another process after the sender exited."""
    import base64

    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _WIRE_PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["during"] == [report["before"]] and report["after"] == report["before"], report
    extra = _pickle_globals(base64.b64decode(report["payload"])) - SGLANG_ADMITTED
    assert not extra, f"globals sglang refuses: {extra}"
    load = ("import base64, sys, torch\nfrom multiprocessing.reduction import ForkingPickler\n"
            "obj = ForkingPickler.loads(base64.b64decode(sys.stdin.read()))\n"
            "print(obj['flattened_tensor'].tolist(), [m.name for m in obj['metadata']])")
    loaded = subprocess.run([sys.executable, "-c", load], input=report["payload"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip() == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 1.0, 1.0, 1.0, 1.0] ['a', 'b']"


# -- issue 24, item 2: no lock-out by unauthenticated clients; bounded batches -------------------------------------
def test_hardening_trickling_clients_cannot_lock_out_an_authorized_one(engine):
    """More unauthenticated connections than --max-connections, each trickling one header byte every 0.3 s (well
    under --idle-timeout-s, so a per-read timeout never fires) and reconnecting whenever it is closed: an authorized
    client is still served at once, and every trickling connection is cut after about --header-timeout-s."""
    tricklers, stop = MAX_CONNECTIONS + 12, threading.Event()
    lifetimes: list[float] = []
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "

    def trickle() -> None:
        def connect() -> tuple[socket.socket, float, int]:
            return socket.create_connection(("127.0.0.1", engine.port), timeout=5), time.monotonic(), 0

        conns = [connect() for _ in range(tricklers)]
        while not stop.wait(0.3):
            for i, (sock, opened, sent) in enumerate(conns):
                try:
                    readable, _, _ = select.select([sock], [], [], 0)
                    if readable and not sock.recv(4096, socket.MSG_DONTWAIT):  # the server closed it
                        raise ConnectionResetError
                    sock.send(head[sent:sent + 1] if sent < len(head) else b"a")
                    conns[i] = (sock, opened, sent + 1)
                except OSError:
                    lifetimes.append(time.monotonic() - opened)
                    sock.close()
                    conns[i] = connect()
        for sock, _, _ in conns:
            sock.close()

    attacker = threading.Thread(target=trickle)
    attacker.start()
    answers = []
    try:
        time.sleep(0.5)
        for _ in range(6):
            started = time.monotonic()
            status = httpx.get(f"{engine.url}/health", headers=AUTH, timeout=5).status_code
            answers.append((status, round(time.monotonic() - started, 2)))
            time.sleep(0.4)
    finally:
        stop.set()
        attacker.join(30)
    print(f"\n[lock-out] authorized answers {answers}; {len(lifetimes)} trickling connections cut, longest held "
          f"{max(lifetimes, default=0):.1f} s", file=sys.stderr)
    assert all(status == 200 and took < 2.0 for status, took in answers), answers
    assert len(lifetimes) >= tricklers and max(lifetimes) < HEADER_TIMEOUT_S + 2.0, \
        (len(lifetimes), max(lifetimes, default=None))


def test_hardening_rows_per_request_are_capped(engine):
    response = _post(engine, "/generate", {"input_ids": [[1, 2]] * (MAX_ROWS + 1),
                                           "sampling_params": {"max_new_tokens": 1}})
    assert response.status_code == 400, (response.status_code, response.text[:200])
    message = response.json()["message"]
    assert f"{MAX_ROWS + 1} rows" in message and "--max-rows-per-request" in message, message


def test_hardening_work_of_a_client_that_went_away_is_aborted(engine):
    """A batched /generate whose client disconnects while it waits (queued behind a paused scheduler) is dropped
    from the engine's queue: /abort_request afterwards finds nothing left to abort."""
    rows = 48
    body = json.dumps({"input_ids": [[1, 2, 3]] * rows, "sampling_params": {"max_new_tokens": 8}})
    engine.client.pause_generation(mode="in_place")
    try:
        with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as sock:
            sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                         f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
            time.sleep(0.5)  # parsed and queued
        time.sleep(1.5)  # the client is gone
        left = _post(engine, "/abort_request", {}).json()["aborted"]
    finally:
        engine.client.continue_generation()
    assert left == 0, f"{left} rows of a client that went away were still queued"


def test_hardening_a_waiting_client_is_answered_when_its_rows_finish(engine):
    """The went-away poll must not block: a request that waits longer than one poll (queued behind a paused
    scheduler for longer than the idle timeout) is answered when its rows finish. Before, the poll waited up to the
    connection's idle timeout for it to become readable and took the timeout for a client gone: a request waiting
    longer was aborted, a shorter one answered only after the timeout (60 s by default: every multi-turn batch
    slower than GONE_POLL_S)."""
    import threading

    engine.client.pause_generation(mode="in_place")
    paused_s = IDLE_TIMEOUT_S + 1.0
    timer = threading.Timer(paused_s, engine.client.continue_generation)
    timer.start()
    started = time.monotonic()
    try:
        response = _post(engine, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                         timeout_s=30)
    finally:
        timer.join()
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text[:200]
    assert response.json()["meta_info"]["finish_reason"]["type"] != "abort", response.text[:300]
    assert elapsed < paused_s + IDLE_TIMEOUT_S, elapsed


# -- issue 24, item 8: one line (400), never a traceback (500) or a silent acceptance --------------------------------
def _norm_numel() -> int:
    from mpo.models.config import PRESETS

    return PRESETS["tiny"].hidden_size  # model.norm.weight


def test_hardening_shm_locator_to_a_fifo_is_refused_at_once(engine):
    """A FIFO named like a slot blocks open(): it must be refused (400), not pin the request's thread forever."""
    from mpo.weight_sync import shared_memory as shm
    from mpo.weight_sync.wire import SHM_FORMAT

    fifo = shm.shm_dir() / shm.file_name(shm.new_token(), "fifo", pid=1)
    os.mkfifo(fifo)
    numel = _norm_numel()
    locator = {"name": "model.norm.weight", "path": str(fifo), "dtype": "float32", "shape": [numel],
               "stride": [1], "offset": 0}
    engine.client.begin_weight_update()
    try:
        response = _post(engine, "/update_weights_from_tensor", {
            "serialized_named_tensors": [json.dumps([locator])], "load_format": SHM_FORMAT}, timeout_s=5)
        assert response.status_code == 400 and "not a regular file" in response.json()["message"], response.text
    finally:
        try:  # a reader blocked in open() is released by a writer's open
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        fifo.unlink()
        engine.client.end_weight_update()


@pytest.mark.parametrize("change, reason", [
    ({"dtype": "int32"}, "dtype int32"),
    ({"dtype": "float64"}, "dtype float64"),
    ({"name": ["model.norm.weight"]}, "unknown tensor"),
], ids=["hardening-int32", "hardening-float64", "hardening-name-list"])
def test_hardening_shm_locator_of_the_wrong_type_is_refused(engine, change, reason):
    """A locator whose dtype is not a weight dtype reinterprets the slot's bytes: refused (400) and nothing applied."""
    from mpo.weight_sync import shared_memory as shm
    from mpo.weight_sync.wire import SHM_FORMAT

    numel = _norm_numel()
    buffer = shm.SharedBuffer(shm.file_name(shm.new_token(), "dtype"), 2 * numel, torch.float32, create=True)
    buffer.tensor.fill_(3.0)
    locator = {**shm.locate("model.norm.weight", buffer.tensor[:numel]).to_json(), **change}
    before = engine.client.call("/weights_checksum", method="GET")["checksum"]
    engine.client.begin_weight_update()
    try:
        response = _post(engine, "/update_weights_from_tensor", {
            "serialized_named_tensors": [json.dumps([locator])], "load_format": SHM_FORMAT})
    finally:
        engine.client.end_weight_update()
        buffer.close()
    assert response.status_code == 400 and reason in response.json()["message"], (response.status_code,
                                                                                    response.text[:300])
    assert engine.client.call("/weights_checksum", method="GET")["checksum"] == before


@pytest.mark.parametrize("tags", [[["weights"]], [{"a": 1}], "weights"], ids=["hardening-nested", "hardening-dict",
                                                                              "hardening-str"])
def test_hardening_release_with_malformed_tags_is_400(engine, tags):
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        response = _post(engine, path, {"tags": tags})
        assert response.status_code == 400 and "tags=" in response.json()["message"], (path, response.text[:300])
    assert httpx.get(f"{engine.url}/health_generate", headers=AUTH, timeout=30).status_code == 200


def test_hardening_a_taken_port_fails_with_the_bind_error():
    """An engine whose port was taken after it was picked (free_port is a race) fails with the OS's error, which the
    engine's log shows; closing the half-made server used to raise an AttributeError over it."""
    from mpo.engine.server import EngineHTTPServer, ServerLimits, make_handler

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="in use") as failed:
            EngineHTTPServer(("127.0.0.1", port), make_handler(None, None, ServerLimits(), loopback=True),
                             ServerLimits())
    assert not isinstance(failed.value, AttributeError)
