"""An HTTP client for one engine speaking SGLang's API (real SGLang or mpo's own engine).

Every failure becomes an EngineError that names the engine URL, the endpoint and, for HTTP errors, the engine's own
message, so a user sees which of many engines failed and why. That includes a malformed /generate answer (not JSON,
JSON nested past the interpreter's stack, a field of the wrong type, a bad frames body): it is checked where it is
decoded (mpo.rollout.protocol, mpo.rollout.frames) and is an engine failure like a 5xx, retried by the rollout pool on
a healthy engine up to its attempts, never an AttributeError or RecursionError that kills a pool worker.
"""

from __future__ import annotations

import asyncio
import functools
import reprlib
import ssl
from typing import Any

import httpx
import numpy as np

from mpo.rollout.frames import CONTENT_TYPE as FRAMES_CONTENT_TYPE, decode_frames, restore_prompt_routes
from mpo.rollout.protocol import GenerateRequest, GenerateResult, call_timeout_s, parse_generate_request

# /generate asks for mpo's binary frames (routes as raw compact bytes); SGLang ignores it and answers JSON
_ACCEPT_FRAMES = {"Accept": f"{FRAMES_CONTENT_TYPE}, application/json"}


class EngineError(RuntimeError):
    """A call to one engine failed. `retryable` is True for transport failures, 5xx and malformed answers, False for
    4xx and for requests refused before sending. Its message is one line: a run it ends stops with it
    (mpo.rollout.pool.rollout_failure, mpo.trainer.__main__)."""

    def __init__(self, url: str, endpoint: str, message: str, *, status: int | None = None,
                 retryable: bool = True) -> None:
        message = " ".join(message.split())  # an engine's body may be a page or a traceback: one line
        where = f"engine {url}: {endpoint}"
        super().__init__(f"{where} returned HTTP {status}: {message}" if status else f"{where} failed: {message}")
        self.url, self.endpoint, self.status, self.retryable = url, endpoint, status, retryable
        self._message = message

    def __reduce__(self):  # pickles (the producer process hands it to rank 0): args are not the message alone
        return (_engine_error, (self.url, self.endpoint, self._message, self.status, self.retryable))


def _engine_error(url: str, endpoint: str, message: str, status: int | None, retryable: bool) -> EngineError:
    return EngineError(url, endpoint, message, status=status, retryable=retryable)


# A value of an engine's answer in an error message: cut short (a malformed answer may be huge or nested deep).
_short = reprlib.Repr(maxlevel=2, maxlist=4, maxdict=4, maxstring=60, maxother=60).repr
_error_repr = reprlib.Repr(maxlevel=6, maxlist=20, maxdict=20, maxstring=500, maxother=500).repr  # an error body


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verifying TLS context, built once per process: building it reads the CA bundle (~17 ms),
    which each new client paid, and each RolloutPool.generate makes one (one async client per event loop)."""
    return httpx.create_ssl_context()


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except (ValueError, RecursionError):  # not JSON, or nested deeper than json.loads can go
        return response.text[:500]
    if isinstance(body, dict):
        body = body.get("message") or body.get("error") or body.get("detail") or body
    return (body if isinstance(body, str) else _error_repr(body))[:500]  # repr() of deep JSON would overflow


class EngineClient:
    """Calls one engine. Sync methods for control calls; `generate` is async for concurrent rollouts."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 300.0,
                 num_layers: int | None = None, topk: int | None = None, num_experts: int | None = None,
                 prompt_routes_once: bool = False) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        # generate_batch asks for a prompt's routes once per call (routed_experts_start_len): for engines answering
        # JSON (SGLang), whose routes of every prompt position of every sample are most of a call's bytes at 32k
        # contexts; mpo's engine shares them in its frames already.
        self.prompt_routes_once = prompt_routes_once
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # routes: [tokens, num_layers (the MoE layers), topk], kept in the dtype num_experts needs (uint8 <= 256)
        self.num_layers, self.topk, self.num_experts = num_layers, topk, num_experts
        # One async client per event loop: each RolloutPool.generate runs its own asyncio loop, and two can run at
        # once on one EngineClient (an async producer's batch and an evaluation), each closing its own at the end.
        self._async: dict[Any, httpx.AsyncClient] = {}
        self._client: httpx.Client | None = None  # made on first call; thread-safe, reused by every call

    def __getstate__(self) -> dict[str, Any]:  # connections stay with the process that opened them
        return {**self.__dict__, "_async": {}, "_client": None}

    def _sync_client(self) -> httpx.Client:
        # One client for every call: httpx.request() builds a fresh Client (and TLS context) per call, ~20 ms each.
        if self._client is None:
            self._client = httpx.Client(headers=self.headers, timeout=self.timeout_s, verify=_tls_context())
        return self._client

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _check(self, endpoint: str, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise EngineError(self.url, endpoint, _error_message(response), status=response.status_code,
                              retryable=response.status_code >= 500)
        if not response.content:
            return None
        if response.headers.get("content-type", "").startswith(FRAMES_CONTENT_TYPE):
            try:
                return restore_prompt_routes(decode_frames(response.content))
            except ValueError as exc:  # a malformed answer: an engine failure, retried like a 5xx
                raise EngineError(self.url, endpoint, f"bad frames body: {exc}") from exc
        try:
            return response.json()
        except RecursionError:  # json.loads' answer to JSON nested past the stack: malformed, retried like a 5xx
            raise EngineError(self.url, endpoint, "bad response: JSON nested deeper than Python's recursion "
                              "limit") from None
        except ValueError:
            return response.text

    def call(self, endpoint: str, body: dict[str, Any] | None = None, *, method: str = "POST",
             timeout_s: float | None = None) -> Any:
        try:
            response = self._sync_client().request(method, f"{self.url}{endpoint}",
                                                   json=body if method == "POST" else None,
                                                   timeout=timeout_s or self.timeout_s)
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:  # no retry can help a URL httpx cannot use
            raise EngineError(self.url, endpoint, f"bad URL: {exc}", retryable=False) from exc
        except httpx.HTTPError as exc:
            raise EngineError(self.url, endpoint, f"{type(exc).__name__}: {exc or 'unreachable'}") from exc
        result = self._check(endpoint, response)
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(self.url, endpoint, str(result.get("message")), status=response.status_code,
                              retryable=False)
        return result

    async def acall(self, endpoint: str, body: dict[str, Any], *, timeout_s: float | None = None,
                    headers: dict[str, str] | None = None) -> Any:
        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            client = self._async[loop] = httpx.AsyncClient(headers=self.headers, timeout=self.timeout_s,
                                                           verify=_tls_context())
        try:
            response = await client.post(f"{self.url}{endpoint}", json=body, timeout=timeout_s or self.timeout_s,
                                         headers=headers)
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:  # no retry can help a URL httpx cannot use
            raise EngineError(self.url, endpoint, f"bad URL: {exc}", retryable=False) from exc
        except httpx.HTTPError as exc:
            raise EngineError(self.url, endpoint, f"{type(exc).__name__}: {exc or 'unreachable'}") from exc
        return self._check(endpoint, response)

    async def aclose(self) -> None:
        """Close this event loop's async client (another loop's, in use on another thread, stays open)."""
        client = self._async.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    # -- generation --------------------------------------------------------------------------------------------
    def _checked(self, body: dict[str, Any]) -> dict[str, Any]:
        """The engine's own /generate validator, run before sending: a bad request fails here, naming the field,
        without a round trip (and never reaches an engine that might accept it, as SGLang does some)."""
        try:
            parse_generate_request(body)
        except ValueError as exc:
            raise self._not_sent(str(exc)) from exc
        if body.get("return_routed_experts") and (self.num_layers is None or self.topk is None):
            raise self._not_sent("routed experts requested but the client does not know the model's num_layers and "
                                 "top_k (EngineClient(num_layers=..., topk=...))")
        return body

    def _not_sent(self, why: str) -> EngineError:
        return EngineError(self.url, "/generate", f"invalid request, not sent: {why}", retryable=False)

    def _results(self, requests: list[GenerateRequest], answers: list[Any]) -> list[GenerateResult]:
        """The parsed answers; a malformed one is an engine failure, retried like a 5xx (the module's docstring)."""
        try:
            return [GenerateResult.from_json(r, a, num_layers=self.num_layers, topk=self.topk,
                                             num_experts=self.num_experts) for r, a in zip(requests, answers)]
        except ValueError as exc:
            raise EngineError(self.url, "/generate", f"bad response: {exc}") from exc

    async def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> GenerateResult:
        """One request; its timeout is timeout_s (default: the client's) plus its token budget (call_timeout_s)."""
        body = await self.acall("/generate", self._checked(request.to_json()),
                                timeout_s=call_timeout_s([request], timeout_s or self.timeout_s),
                                headers=_ACCEPT_FRAMES)
        if isinstance(body, str):
            raise EngineError(self.url, "/generate", f"bad response: not JSON: {_short(body)}")
        return self._results([request], [body])[0]

    async def generate_batch(self, requests: list[GenerateRequest], *,
                             timeout_s: float | None = None) -> list[GenerateResult]:
        """Several requests in one /generate call (SGLang's batch form). The engine sees them together and in order,
        so its batching, and so its numerics, do not depend on request timing. The call's timeout is timeout_s
        (default: the client's) plus its token budget (call_timeout_s).

        With prompt_routes_once and routes asked for, a prompt's later samples go in a second call sent alongside,
        with routed_experts_start_len (SGLang's field is one per call): the first sample of each prompt brings the
        prompt's routes, the others only their own rows, and the prompt's are put back into theirs."""
        first = requests[0]
        if any(r.return_logprob != first.return_logprob or r.return_routed_experts != first.return_routed_experts
               for r in requests):
            raise self._not_sent("a batched /generate needs the same return_logprob / return_routed_experts "
                                 "everywhere")
        if self.prompt_routes_once and first.return_routed_experts:
            owner: dict[tuple[int, ...], int] = {}
            for i, r in enumerate(requests):
                owner.setdefault(tuple(r.input_ids), i)
            repeats = [i for i, r in enumerate(requests) if owner[tuple(r.input_ids)] != i]
            if repeats:
                return await self._prompt_routes_once(requests, owner, repeats, timeout_s)
        return await self._one_call(requests, timeout_s)

    async def _prompt_routes_once(self, requests: list[GenerateRequest], owner: dict, repeats: list[int],
                                  timeout_s: float | None) -> list[GenerateResult]:
        from dataclasses import replace

        firsts = sorted(set(owner.values()))
        start = min(len(requests[i].input_ids) for i in repeats)
        later = [replace(requests[i], routed_experts_start_len=start) for i in repeats]
        whole, partial = await asyncio.gather(self._one_call([requests[i] for i in firsts], timeout_s),
                                              self._one_call(later, timeout_s))
        out: list[GenerateResult | None] = [None] * len(requests)
        for i, result in zip(firsts, whole):
            out[i] = result
        for i, result in zip(repeats, partial):
            source = out[owner[tuple(requests[i].input_ids)]]
            if result.routed_experts is not None:
                result.routed_experts = np.concatenate([source.routed_experts[:start], result.routed_experts])
            out[i] = result
        return out

    async def _one_call(self, requests: list[GenerateRequest], timeout_s: float | None) -> list[GenerateResult]:
        if len(requests) == 1:
            return [await self.generate(requests[0], timeout_s=timeout_s)]
        first = requests[0]
        body = {**first.to_json(), "input_ids": [list(r.input_ids) for r in requests],
                "sampling_params": [r.sampling.to_json() for r in requests]}
        body.pop("rid", None)
        answers = await self.acall("/generate", self._checked(body),
                                   timeout_s=call_timeout_s(requests, timeout_s or self.timeout_s),
                                   headers=_ACCEPT_FRAMES)
        if not isinstance(answers, list) or len(answers) != len(requests):
            raise EngineError(self.url, "/generate", f"bad response: a batch of {len(requests)} answered with "
                              f"{f'{len(answers)} answers' if isinstance(answers, list) else _short(answers)}")
        return self._results(requests, answers)

    # -- health and control ------------------------------------------------------------------------------------
    def healthy(self, timeout_s: float = 30.0) -> bool:
        try:
            self.call("/health_generate", method="GET", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    def server_info(self) -> dict[str, Any]:
        return self.call("/server_info", method="GET")

    def abort_all(self) -> None:
        self.call("/abort_request", {"abort_all": True})

    def pause_generation(self, mode: str = "retract") -> None:
        self.call("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.call("/continue_generation", {})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Colocated engines: hand back GPU memory ("weights", "kv_cache"; None: all) while the trainer runs.
        SGLang needs --enable-memory-saver and an idle server."""
        self.call("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.call("/resume_memory_occupation", {"tags": tags})

    # -- weight updates (inside begin/end since sglang 0.5.21) -------------------------------------------------
    def begin_weight_update(self) -> None:
        self.call("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self.call("/end_weight_update", {})

    def update_weights_from_tensor(self, serialized_per_tp_rank: list[str], *, load_format: str | None,
                                   weight_version: str | None = None) -> None:
        self.call("/update_weights_from_tensor", {"serialized_named_tensors": serialized_per_tp_rank,
                                                  "load_format": load_format, "flush_cache": True,
                                                  "weight_version": weight_version})

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        self.call("/init_weights_update_group", {"master_address": master_address, "master_port": master_port,
                                                 "rank_offset": rank_offset, "world_size": world_size,
                                                 "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, load_format: str | None = None,
                                        weight_version: str | None = None) -> None:
        self.call("/update_weights_from_distributed", {"names": names, "dtypes": dtypes, "shapes": shapes,
                                                       "group_name": group_name, "load_format": load_format,
                                                       "weight_version": weight_version, "flush_cache": True})
