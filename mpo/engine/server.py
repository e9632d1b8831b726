"""SGLang's HTTP API (the subset an RL trainer uses) in front of MpoGenerator, on the standard library's server.

Routes and response shapes follow sglang 0.5.23's HTTP server: errors are HTTP 400 with
{"success": false, "message": ...}; weight updates must run between /begin_weight_update and /end_weight_update.

One request harms no one else: ServerLimits says what one client can take (mpo.engine.admission: trickling clients
hold no slot); the API key and the declared body size are checked from the headers before the body is read (401,
413), every /generate field and its row count are validated before anything is queued (400 naming the field), a
request whose client went away is aborted, and the generator isolates a failure to the request it belongs to.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import io
import json
import logging
import select
import socket
import threading
from dataclasses import dataclass, fields
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from mpo.parallel.ports import is_loopback
from mpo.engine.admission import HeaderGate, RequestReader
from mpo.engine.generator import MpoGenerator
from mpo.rollout.frames import (CONTENT_TYPE as FRAMES_CONTENT_TYPE, encode_frames, frames_answer, sglang_json,
                               wants_frames)
from mpo.rollout.protocol import SamplingParams, parse_generate_request

log = logging.getLogger(__name__)

Route = Callable[[dict[str, Any]], Any]


PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's pause_generation modes (PauseGenerationReqInput.mode)
# SGLang 0.5.23's words (Scheduler.flush_cache, WeightUpdater.flush_cache_after_weight_update)
FLUSH_REFUSED = "Cache not flushed because there are pending requests (running, or queued while not paused)"
UPDATE_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                      "queued. Retract or finish them, then call /flush_cache.")
MEMORY_TAGS = ("weights", "kv_cache")  # SGLang's GPU memory tags (ReleaseMemoryOccupationReqInput.tags)
DEFAULT_MAX_ROWS = 16384  # rows of one batched /generate (--max-rows-per-request)

# The request a connection thread serves: `_CALLER.gone()` is True once its client has gone (unset outside a request).
_CALLER = threading.local()


class RequestError(Exception):
    """The request is wrong: answered with HTTP 400 and this message."""


class RefusedRequest(Exception):
    """Answered before the body is read, then the connection is closed (its unread body makes it unusable)."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class EngineUnhealthy(Exception):
    """Answered with HTTP 503, as SGLang's /health_generate does while unhealthy."""


class EngineApp:
    """The route table; weight-update routes are added by the owner of the model (see mpo.engine.main)."""

    def __init__(self, generator: MpoGenerator, *, info: dict[str, Any], max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.generator = generator
        self.info = info
        self.max_rows = max_rows  # rows of one /generate: a huge batch is refused before it is parsed or queued
        self.in_weight_update = False
        self.end_hooks: list[Callable[[], None]] = []  # run at /end_weight_update (staged updates take effect)
        self.routes: dict[tuple[str, str], Route] = {}
        for path in ("/health", "/ready"):
            self.add("GET", path, lambda body: {"status": "ok"})
        self.add("GET", "/health_generate", self._health_generate)
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            self.add("GET", path, lambda body: {**self.info, "weight_version": self.generator.weight_version})
        for path, route in (("/generate", self._generate), ("/pause_generation", self._pause),
                            ("/continue_generation", self._continue), ("/begin_weight_update", self._begin),
                            ("/end_weight_update", self._end),
                            ("/abort_request", lambda body: {"success": True, "aborted": self.generator.abort_all()})):
            self.add("POST", path, route)
        for method in ("GET", "POST"):  # SGLang's /flush_cache takes both
            self.add(method, "/flush_cache", self._flush)
        # Colocated engines (SGLang --enable-memory-saver): free GPU memory while the trainer runs, take it back
        # for generation. Tags as SGLang's: "weights", "kv_cache"; none means all.
        self.released: set[str] = set()
        for method in ("GET", "POST"):
            self.add(method, "/release_memory_occupation", self._release)
            self.add(method, "/resume_memory_occupation", self._resume)

    def add(self, method: str, path: str, route: Route) -> None:
        self.routes[(method, path)] = route

    def require_weight_update_session(self, endpoint: str) -> None:
        self.require_memory(endpoint, ("weights",))
        if not self.in_weight_update:
            raise RequestError(f"{endpoint} must run between begin_weight_update() and end_weight_update()")

    # -- routes ------------------------------------------------------------------------------------------------
    def _health_generate(self, body: dict[str, Any]) -> dict[str, Any]:
        # Like SGLang: healthy means a 1-token generation completes, so a hung scheduler reports unhealthy.
        try:
            self.generator.submit([0], SamplingParams(temperature=0, max_new_tokens=1), timeout_s=20.0)
        except TimeoutError as exc:
            raise EngineUnhealthy(str(exc)) from exc
        return {"status": "ok"}

    @staticmethod
    def _tags(body: dict[str, Any]) -> set[str]:
        tags = body.get("tags")
        if tags is None:
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) and t in MEMORY_TAGS for t in tags):
            raise RequestError(f"tags={tags!r}: expected null or a list of {', '.join(map(repr, MEMORY_TAGS))}")
        return set(tags)

    def _release(self, body: dict[str, Any]) -> dict[str, Any]:
        tags = self._tags(body)
        # SGLang asserts the scheduler is idle: releasing under running requests would pull memory from under them.
        if self.generator.busy():
            raise RequestError("release_memory_occupation: requests are running; wait for them or pause first")
        self.released |= tags
        # This engine's weights and activations live in process memory on CPU: there is nothing to hand back, so
        # only the protocol state changes (generation and weight updates are refused while their memory is out).
        return {"success": True, "message": f"released {sorted(tags)}"}

    def _resume(self, body: dict[str, Any]) -> dict[str, Any]:
        self.released -= self._tags(body)
        return {"success": True, "message": f"resumed; still released: {sorted(self.released)}"}

    def require_memory(self, endpoint: str, tags: tuple[str, ...]) -> None:
        missing = sorted(set(tags) & self.released)
        if missing:
            raise RequestError(f"{endpoint}: memory of {missing} is released; call resume_memory_occupation first")

    def _generate(self, body: dict[str, Any]) -> Any:
        self.require_memory("generate", MEMORY_TAGS)
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], list) and len(ids) > self.max_rows:
            raise RequestError(f"input_ids has {len(ids)} rows; this engine takes at most {self.max_rows} per request "
                               f"(--max-rows-per-request): send them in several requests")
        # Everything is checked before anything is queued: a bad request is refused alone and never joins a batch.
        try:
            request = parse_generate_request(body, vocab_size=self.generator.vocab_size,
                                             context_length=self.info.get("context_length"))
            logprob_start_len = _logprob_start_len(body)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        # Like SGLang without --enable-return-routed-experts: silently no routes.
        want_routes = request.return_routed_experts and bool(self.info.get("enable_return_routed_experts"))
        try:
            results = self.generator.submit_many(request.rows, request.sampling, routed_experts=want_routes,
                                                 rids=request.rids, logprob_start_len=logprob_start_len,
                                                 gone=getattr(_CALLER, "gone", None))  # no one to answer: rows aborted
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        start = request.routed_experts_start_len
        if start and want_routes:  # SGLang's routed_experts_start_len: rows of positions [start, n-1) only
            results = [{**r, "meta_info": {**meta, "routed_experts": meta["routed_experts"][start:]}}
                       if isinstance(meta := r.get("meta_info"), dict) and "routed_experts" in meta else r
                       for r in results]
        return results if request.batch else results[0]

    def _pause(self, body: dict[str, Any]) -> dict[str, Any]:
        mode = body.get("mode", "abort")  # SGLang's PauseGenerationReqInput default
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause_generation: mode={mode!r} must be one of {', '.join(map(repr, PAUSE_MODES))}")
        if mode == "abort":
            self.generator.abort_all()
        self.generator.pause(mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def _flush(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's rule (can_flush), kept though this engine keeps no cache between requests."""
        if not self.generator.can_flush():
            raise RequestError(FLUSH_REFUSED)
        return {"success": True, "message": "Cache flushed."}

    def flush_after_update(self, body: dict[str, Any], endpoint: str) -> None:
        """A weight update's flush_cache (SGLang's default: true), checked as SGLang does after loading: the update
        stands (staged here), the call fails with SGLang's message when the flush is refused."""
        if body.get("flush_cache", True) and not self.generator.can_flush():
            raise RequestError(f"{endpoint}: {UPDATE_NOT_FLUSHED}")

    def _continue(self, body: dict[str, Any]) -> dict[str, Any]:
        self.generator.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _begin(self, body: dict[str, Any]) -> dict[str, Any]:
        self.in_weight_update = True
        return {"success": True, "message": "Success"}

    def _end(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            for hook in self.end_hooks:
                hook()
        finally:
            self.in_weight_update = False
        return {"success": True, "message": "Success"}


@dataclass(frozen=True)
class ServerLimits:
    """What one client can take from the engine's HTTP server, so a bad or hostile request harms no one else.

    Attributes:
        max_body_bytes: largest request body. A larger declared Content-Length is answered 413 before any of the
            body is read. The default fits a weight bucket of sync.bucket_mb=64 after base64 (x4/3) with room
            to spare; raise it (--max-body-mb) together with a larger bucket_mb.
        idle_timeout_s: a kept-alive connection that sends nothing for this long between requests is closed (also
            bounds a stalled body upload between two reads).
        header_timeout_s: a request's line and headers must arrive whole within this long of the connection (of the
            request's first byte, on a kept-alive connection), however they trickle in; the connection is closed
            otherwise (408). Until then a new connection holds no slot (mpo.engine.admission); nor until a body of
            at most GATE_BODY_BYTES has arrived too, under the same deadline.
        body_timeout_s, min_body_bytes_per_s: a body the handler reads (a larger one, or on a kept-alive
            connection) must arrive within body_timeout_s plus one second per min_body_bytes_per_s bytes, and at
            every moment be no further behind (mpo.engine.admission.RequestReader); the connection is closed
            otherwise and its slot freed. A 64 MiB weight bucket sent at loopback speed takes well under a second.
            Bodies larger than GATE_BODY_BYTES are read by at most half the slots at once (503 beyond, before the
            connection takes a slot), so slow large uploads cannot take the slots every other request needs.
        max_connections: connections served at once, one thread each, taken once a request's headers are complete.
            One more is answered 503 and closed, so clients cannot make the engine grow threads without bound.
        max_pending_connections: new connections waiting for their headers (no thread each); beyond it the oldest
            is closed, so connections that never finish their headers cannot keep a prompt client out.
        max_header_bytes: request line and headers larger than this are answered 431 and closed.
        listen_backlog: connections the kernel queues before they are accepted. It must cover a rollout pool's burst
            of new connections arriving while the accept loop is held up (docs/measurements.md: a backlog of 5).
    """

    max_body_bytes: int = 256 << 20
    idle_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    min_body_bytes_per_s: float = float(1 << 20)
    max_connections: int = 128
    max_pending_connections: int = 256
    max_header_bytes: int = 64 << 10
    listen_backlog: int = 128

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self)):
            if not getattr(self, name) > 0:
                raise ValueError(f"server limits: {name}={getattr(self, name)} must be > 0")


# Routes that replace the served weights or join process groups. An engine without a key serves them only on a
# loopback address: anyone who can reach it could otherwise swap its weights.
KEYLESS_LOOPBACK_ONLY = frozenset({"/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
                                   "/update_weights_from_disk", "/update_weights_from_distributed",
                                   "/init_weights_update_group", "/destroy_weights_update_group"})


def authorized(headers: Message, api_key: str | None) -> bool:
    """The request carries `Bearer <api_key>` (constant-time comparison), or the engine has no key. It sees only
    the headers: it runs before a byte of the body is read."""
    if not api_key:
        return True
    return hmac.compare_digest(str(headers.get("Authorization") or "").encode(), f"Bearer {api_key}".encode())


# A refused request's body is drained (not parsed) up to this size before the connection closes: closing a socket
# with unread input makes the kernel send a reset, which can destroy the answer before the client reads it. Larger
# bodies are not read at all; the client then sees the answer or a reset, both of which say "not accepted". The
# drain has a total deadline: a refused client must not hold its slot by trickling the body.
_DRAIN_LIMIT = 64 << 10
_DRAIN_S = 1.0
# Bodies up to this size are awaited by the admission gate before the request takes a slot (mpo.engine.admission):
# every control call and most /generate batches; weight buckets are larger and are read by the handler.
GATE_BODY_BYTES = 256 << 10


def gate_body_bytes(head: bytes, api_key: str | None, limits: ServerLimits) -> int:
    """How much body the admission gate awaits for the request whose line and headers are `head`: its declared
    Content-Length when the handler will read that body (the key matches, or the engine has none; no chunked body,
    no Expect: 100-continue, within the size limits), else 0: such a request is answered from its headers (401,
    413, ...) or has its body read by the handler."""
    headers = _parsed_headers(head)
    if headers is None or (headers.get("Expect") or "").strip().lower() == "100-continue":
        return 0
    length = _authorized_length(headers, api_key)
    return length if length <= min(GATE_BODY_BYTES, limits.max_body_bytes) else 0


def declares_upload(head: bytes, api_key: str | None, limits: ServerLimits) -> bool:
    """Whether the request whose line and headers are `head` will have a large body (over GATE_BODY_BYTES, within
    max_body_bytes) read by the handler: such a connection takes one of the upload places before a slot."""
    headers = _parsed_headers(head)
    return headers is not None and GATE_BODY_BYTES < _authorized_length(headers, api_key) <= limits.max_body_bytes


def _parsed_headers(head: bytes) -> http.client.HTTPMessage | None:
    _, _, rest = head.partition(b"\n")
    try:
        return http.client.parse_headers(io.BytesIO(rest))
    except http.client.HTTPException:  # too many or too long header lines: the handler answers them
        return None


def _authorized_length(headers: http.client.HTTPMessage, api_key: str | None) -> int:
    """The declared Content-Length of a request the handler will read a body of (the key matches, or the engine has
    none; no chunked body), else 0."""
    if headers.get("Transfer-Encoding") or not authorized(headers, api_key):
        return 0
    text = (headers.get("Content-Length") or "0").strip()
    return int(text) if text.isascii() and text.isdigit() else 0


def _logprob_start_len(body: dict[str, Any]) -> int:
    """SGLang's logprob_start_len: -1 (no prompt log-probs) or the first prompt position to score."""
    value = body.get("logprob_start_len", -1)
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"logprob_start_len must be an integer >= -1, got {value!r}")
    return value


def _declared_length(headers: Message, limit: int) -> int:
    """The body size the client declared; RefusedRequest if it is unusable or over the limit."""
    if headers.get("Transfer-Encoding"):
        raise RefusedRequest(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length (chunked transfer "
                                                         "encoding is not supported)")
    text = (headers.get("Content-Length") or "0").strip()
    if not (text.isascii() and text.isdigit()):
        raise RefusedRequest(HTTPStatus.BAD_REQUEST, f"Content-Length {text!r} is not a byte count")
    length = int(text)
    if length > limit:
        raise RefusedRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"request body of {length} bytes exceeds the engine's limit of {limit} bytes "
                             f"(--max-body-mb {limit / (1 << 20):g}); weight updates: lower sync.bucket_mb or "
                             f"start the engine with a larger --max-body-mb")
    return length


def make_handler(app: EngineApp, api_key: str | None, limits: ServerLimits = ServerLimits(), *,
                 loopback: bool = True) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Kept-alive connections: without TCP_NODELAY a reply's two writes meet the client's delayed ACK (40 ms).
        disable_nagle_algorithm = True
        timeout = limits.idle_timeout_s  # socket timeout: an idle connection is closed, its thread freed

        def setup(self) -> None:
            super().setup()
            # The request's first bytes were read by the admission gate: the handler reads them, then the socket,
            # through a reader that puts a total deadline on every request's headers.
            self.rfile.close()
            self.reader = RequestReader(self.connection, self.server.take_prefix(self.connection),
                                        idle_timeout_s=limits.idle_timeout_s, header_timeout_s=limits.header_timeout_s,
                                        body_timeout_s=limits.body_timeout_s,
                                        min_body_bytes_per_s=limits.min_body_bytes_per_s)
            self.rfile = io.BufferedReader(self.reader, 1 << 16)

        def handle_one_request(self) -> None:
            self.reader.begin_headers()
            super().handle_one_request()

        def parse_request(self) -> bool:
            ok = super().parse_request()
            self.reader.end_headers()
            return ok

        def _client_gone(self) -> bool:
            """The client closed or reset its connection (a pending request then has no one to answer).

            select() first: the connection has a timeout (RequestReader sets the idle timeout), and Python waits
            that long for a timed socket to be readable before any recv, MSG_DONTWAIT or not; every poll of a
            generation slower than GONE_POLL_S then stalled the answer by idle_timeout_s (60 s)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                if not readable:
                    return False  # nothing to read: still there
                return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except (OSError, ValueError):
                return True

        def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, not stderr
            log.debug("%s - " + fmt, self.address_string(), *args)

        def _reply(self, status: int, payload: Any, *, close: bool = False) -> None:
            # /generate answers hold their routes as compact arrays: raw bytes for a client that asked for mpo's
            # frames, SGLang's base64 int32 JSON for everyone else (mpo.rollout.frames)
            if status == HTTPStatus.OK and wants_frames(self.headers.get("Accept")):
                data, content_type = encode_frames(frames_answer(payload)), FRAMES_CONTENT_TYPE
            else:
                data, content_type = json.dumps(sglang_json(payload)).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _refuse(self, exc: RefusedRequest, *, drain: bool = True) -> None:
            self._reply(exc.status, {"success": False, "message": str(exc)}, close=True)
            text = (self.headers.get("Content-Length") or "").strip()
            if drain and text.isascii() and text.isdigit() and int(text) <= _DRAIN_LIMIT:
                self.reader.limit(_DRAIN_S)
                with contextlib.suppress(OSError):
                    self.rfile.read(int(text))

        def _admit(self, method: str) -> tuple[Route, int]:
            """The route and body length, judged from the request line and headers alone (RefusedRequest)."""
            if not authorized(self.headers, api_key):
                raise RefusedRequest(HTTPStatus.UNAUTHORIZED, "Unauthorized")
            path = self.path.split("?", 1)[0]
            if not api_key and not loopback and path in KEYLESS_LOOPBACK_ONLY:
                raise RefusedRequest(HTTPStatus.FORBIDDEN, (
                    f"{path} refused: this engine has no API key and listens on a non-loopback address; start it "
                    f"with MPO_API_KEY set (or --api-key-file), or bind it to 127.0.0.1"))
            route = app.routes.get((method, path)) or app.routes.get(("POST" if method == "GET" else "GET", path))
            if route is None:
                raise RefusedRequest(HTTPStatus.NOT_FOUND, f"no route {method} {path}")
            return route, _declared_length(self.headers, limits.max_body_bytes)

        def handle_expect_100(self) -> bool:
            # "Expect: 100-continue" asks whether to send the body: only after the same checks (the base class
            # says yes to everyone). Refused: the client sends no body, so there is nothing to drain.
            try:
                self._admit("GET" if self.command == "GET" else "POST")
            except RefusedRequest as exc:
                self._refuse(exc, drain=False)
                return False
            return super().handle_expect_100()

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                route, length = self._admit(method)
            except RefusedRequest as exc:
                return self._refuse(exc)
            # a large body takes an upload place; the connection holds one already if its first request was large
            holds = self.server.holds_upload_place(self.request)
            uploads = self.server.uploads if length > GATE_BODY_BYTES and not holds else None
            if uploads is not None and not uploads.acquire(blocking=False):
                return self._refuse(RefusedRequest(HTTPStatus.SERVICE_UNAVAILABLE, (
                    f"engine busy: {self.server.max_uploads} large request bodies are being received; retry later")),
                    drain=False)
            self.reader.begin_body()  # a total deadline: a trickled body loses its slot
            try:
                raw = self.rfile.read(length) if length else b""
            except OSError:  # past the body's deadline, or reset: nothing to answer
                raw = b""
            finally:
                if uploads is not None:
                    uploads.release()
            if len(raw) < length:  # the client stalled or went away mid-body
                self.close_connection = True
                return
            try:
                body = json.loads(raw) if raw else {}
            except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8/16/32
                return self._reply(HTTPStatus.BAD_REQUEST, {"success": False, "message": f"body is not JSON: {exc}"})
            if not isinstance(body, dict):
                return self._reply(HTTPStatus.BAD_REQUEST, {"success": False, "message": "the request body must be a "
                                                            f"JSON object, got {type(body).__name__}"})
            _CALLER.gone = self._client_gone
            try:
                status, payload = HTTPStatus.OK, route(body)
            except RequestError as exc:
                status, payload = HTTPStatus.BAD_REQUEST, {"success": False, "message": str(exc)}
            except EngineUnhealthy as exc:
                status, payload = HTTPStatus.SERVICE_UNAVAILABLE, {"success": False, "message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - an engine bug: one line to the client, the traceback to the log
                log.exception("mpo engine: %s %s failed", method, path)
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, {
                    "success": False, "message": f"internal error in {path}: {type(exc).__name__}"
                                                 f"{': ' + first if first else ''} (traceback in the engine log)"}
            finally:
                _CALLER.gone = None
            try:
                self._reply(status, payload)
            except OSError:  # the client went away before its answer
                self.close_connection = True

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        do_PUT = do_POST

    return Handler


class EngineHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a bounded number of connection threads, taken only by connections whose request
    headers arrived whole in time (mpo.engine.admission), and a listen backlog sized by ServerLimits."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: ServerLimits, *,
                 api_key: str | None = None) -> None:
        self.request_queue_size = limits.listen_backlog  # read by server_activate (listen) inside __init__
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        # connections reading a body larger than GATE_BODY_BYTES (weight buckets): half the slots at most
        self.max_uploads = max(1, limits.max_connections // 2)
        self.uploads = threading.BoundedSemaphore(self.max_uploads)
        # connections whose first request declared a large body: they took an upload place before their slot, so
        # that the connections refused for want of one never hold a slot (they would keep /health at 503), and keep it
        # until they close
        self._upload_places: set[socket.socket] = set()
        self._api_key = api_key
        self._prefixes: dict[socket.socket, bytes] = {}  # what the gate read from a connection handed over
        super().__init__(address, handler)
        self._gate = HeaderGate(self._admit, header_timeout_s=limits.header_timeout_s,
                                max_pending=limits.max_pending_connections, max_header_bytes=limits.max_header_bytes,
                                body_bytes=lambda head: gate_body_bytes(head, api_key, limits))

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        self._gate.add(request, client_address)  # its headers are awaited without a thread

    def take_prefix(self, request: socket.socket) -> bytes:
        return self._prefixes.pop(request, b"")

    def server_close(self) -> None:
        # also called by socketserver's __init__ when bind or listen fails, before the gate exists: the caller must
        # see that OSError (e.g. the port taken since it was picked), not an AttributeError raised over it
        gate = getattr(self, "_gate", None)
        if gate is not None:
            gate.close()
        super().server_close()

    def _admit(self, request: socket.socket, client_address: Any, prefix: bytes) -> None:
        """Called by the gate for a connection whose request headers are complete: a slot and a thread, or 503. A
        request declaring a large body first takes an upload place (half the slots at most), or is answered 503."""
        upload = declares_upload(prefix, self._api_key, self.limits)
        if upload and not self.uploads.acquire(blocking=False):
            self._answer_busy(request, f"{self.max_uploads} large request bodies are being received")
            return
        if not self._slots.acquire(blocking=False):
            if upload:
                self.uploads.release()
            self._answer_busy(request)
            return
        self._prefixes[request] = prefix
        if upload:
            self._upload_places.add(request)
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._prefixes.pop(request, None)
            self._release(request)
            raise

    def holds_upload_place(self, request: socket.socket) -> bool:
        return request in self._upload_places

    def _release(self, request: socket.socket) -> None:
        if request in self._upload_places:
            self._upload_places.discard(request)
            self.uploads.release()
        self._slots.release()

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _answer_busy(self, request: socket.socket, why: str | None = None) -> None:
        """503 (retryable for mpo's pool) without a thread: written by the accept loop, then closed."""
        why = why or f"{self.limits.max_connections} connections open (--max-connections)"
        body = json.dumps({"success": False, "message": f"engine busy: {why}; retry later"}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        with contextlib.suppress(OSError):
            request.settimeout(1.0)  # a client that does not read must not stall the accept loop
            request.sendall(head + body)
        self.shutdown_request(request)


def serve(app: EngineApp, host: str, port: int, api_key: str | None = None,
          limits: ServerLimits = ServerLimits()) -> ThreadingHTTPServer:
    """Start serving in a background thread; returns the server (call .shutdown() to stop)."""
    server = EngineHTTPServer((host, port), make_handler(app, api_key, limits, loopback=is_loopback(host)), limits,
                              api_key=api_key)
    # polled every 50 ms: shutdown() waits for the loop to notice (the default 0.5 s, paid by every engine stop)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="mpo-engine-http",
                     daemon=True).start()
    return server
