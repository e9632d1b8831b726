"""SGLang's HTTP API (the subset an RL trainer uses) in front of MpoGenerator, on the standard library's server.

Routes and response shapes follow sglang 0.5.23 (../shared/spec/sglang.md, part 2): errors are HTTP 400 with
{"success": false, "message": ...}; weight updates must run between /begin_weight_update and /end_weight_update.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from mpo.parallel.ports import is_loopback
from mpo.rollout.mpo_engine.generator import MpoGenerator
from mpo.rollout.protocol import SamplingParams

log = logging.getLogger(__name__)

Route = Callable[[dict[str, Any]], Any]


class RequestError(Exception):
    """The request is wrong: answered with HTTP 400 and this message."""


class EngineUnhealthy(Exception):
    """Answered with HTTP 503, as SGLang's /health_generate does while unhealthy."""


class EngineApp:
    """The route table; weight-update routes are added by the owner of the model (see mpo_engine.main)."""

    def __init__(self, generator: MpoGenerator, *, info: dict[str, Any]) -> None:
        self.generator = generator
        self.info = info
        self.in_weight_update = False
        self.end_hooks: list[Callable[[], None]] = []  # run at /end_weight_update (staged updates take effect)
        self.routes: dict[tuple[str, str], Route] = {}
        for path in ("/health", "/ready"):
            self.add("GET", path, self._health)
        self.add("GET", "/health_generate", self._health_generate)
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            self.add("GET", path, lambda body: {**self.info, "weight_version": self.generator.weight_version})
        self.add("POST", "/generate", self._generate)
        self.add("POST", "/abort_request", self._abort)
        self.add("POST", "/pause_generation", self._pause)
        self.add("POST", "/continue_generation", self._continue)
        self.add("POST", "/flush_cache", lambda body: {"success": True, "message": "no cache to flush"})
        self.add("POST", "/begin_weight_update", self._begin)
        self.add("POST", "/end_weight_update", self._end)

    def add(self, method: str, path: str, route: Route) -> None:
        self.routes[(method, path)] = route

    def require_weight_update_session(self, endpoint: str) -> None:
        if not self.in_weight_update:
            raise RequestError(f"{endpoint} must run between begin_weight_update() and end_weight_update()")

    # -- routes ------------------------------------------------------------------------------------------------
    def _health(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok"}

    def _health_generate(self, body: dict[str, Any]) -> dict[str, Any]:
        # Like SGLang: healthy means a 1-token generation completes, so a hung scheduler reports unhealthy.
        try:
            self.generator.submit([0], SamplingParams(temperature=0, max_new_tokens=1), timeout_s=20.0)
        except TimeoutError as exc:
            raise EngineUnhealthy(str(exc)) from exc
        return {"status": "ok"}

    def _generate(self, body: dict[str, Any]) -> Any:
        if "input_ids" not in body:
            raise RequestError("mpo engine needs input_ids (it has no tokenizer); text input is not supported")
        ids = body["input_ids"]
        batch = ids and isinstance(ids[0], list)
        rows = ids if batch else [ids]
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(rows)
        try:
            sampling = [SamplingParams.from_json(p) for p in params_list]
        except (TypeError, ValueError) as exc:
            raise RequestError(f"bad sampling_params: {exc}") from exc
        want_routes = bool(body.get("return_routed_experts"))
        if want_routes and not self.info.get("enable_return_routed_experts"):
            want_routes = False  # like SGLang without --enable-return-routed-experts: silently no routes
        try:
            results = self.generator.submit_many(rows, sampling, routed_experts=want_routes, rid=body.get("rid"),
                                                 logprob_start_len=int(body.get("logprob_start_len", -1)))
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        return results if batch else results[0]

    def _abort(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"success": True, "aborted": self.generator.abort_all()}

    def _pause(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("mode", "abort") == "abort":
            self.generator.abort_all()
        self.generator.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

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


# Routes that replace the served weights or join process groups. An engine without a key serves them only on a
# loopback address: anyone who can reach it could otherwise swap its weights.
KEYLESS_LOOPBACK_ONLY = frozenset({"/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
                                   "/update_weights_from_disk", "/update_weights_from_distributed",
                                   "/init_weights_update_group", "/destroy_weights_update_group"})


def authorized(headers: Any, api_key: str | None) -> bool:
    """The request carries `Bearer <api_key>` (constant-time comparison), or the engine has no key."""
    if not api_key:
        return True
    return hmac.compare_digest(str(headers.get("Authorization") or "").encode(), f"Bearer {api_key}".encode())


def make_handler(app: EngineApp, api_key: str | None, *, loopback: bool = True) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, not stderr
            log.debug("%s - " + fmt, self.address_string(), *args)

        def _reply(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not authorized(self.headers, api_key):
                return self._reply(HTTPStatus.UNAUTHORIZED, {"success": False, "message": "Unauthorized"})
            if not api_key and not loopback and path in KEYLESS_LOOPBACK_ONLY:
                return self._reply(HTTPStatus.FORBIDDEN, {"success": False, "message": (
                    f"{path} refused: this engine has no API key and listens on a non-loopback address; start it "
                    f"with MPO_API_KEY set (or --api-key-file), or bind it to 127.0.0.1")})
            route = app.routes.get((method, path)) or app.routes.get(("POST" if method == "GET" else "GET", path))
            if route is None:
                return self._reply(HTTPStatus.NOT_FOUND, {"success": False, "message": f"no route {method} {path}"})
            try:
                body = json.loads(raw) if raw else {}
                return self._reply(HTTPStatus.OK, route(body))
            except (RequestError, json.JSONDecodeError) as exc:
                return self._reply(HTTPStatus.BAD_REQUEST, {"success": False, "message": str(exc)})
            except EngineUnhealthy as exc:
                return self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"success": False, "message": str(exc)})
            except Exception as exc:  # noqa: BLE001 - report, keep serving
                log.exception("mpo engine: %s %s failed", method, path)
                return self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"success": False,
                                                                      "message": f"{type(exc).__name__}: {exc}"})

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        do_PUT = do_POST

    return Handler


def serve(app: EngineApp, host: str, port: int, api_key: str | None = None) -> ThreadingHTTPServer:
    """Start serving in a background thread; returns the server (call .shutdown() to stop)."""
    server = ThreadingHTTPServer((host, port), make_handler(app, api_key, loopback=is_loopback(host)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="mpo-engine-http", daemon=True).start()
    return server
