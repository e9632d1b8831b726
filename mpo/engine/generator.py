"""mpo's own generation engine: the mpo model (transformers' implementation, mpo.engine.model) behind SGLang's API.

Batches with a KV cache (transformers' DynamicCache, read and filled by the model's own attention): queued rows start
together as one batch; one prefill forward covers the positions every row already knows (up to the shortest prompt),
then each decode step is one forward of one token per row at the next position, all rows at the same position (a row
whose prompt is longer feeds its next prompt token there instead of a sampled one, as megatron's static-batch
generation does). Rows that finish leave the batch; queued rows start when it is empty.
A batch holds the rows of one call (one submit_many: one /generate) only, the first max_batch of them still queued:
its forwards, and so its numbers, are then a function of that call alone, never of which other calls happened to be
in flight (with several calls in flight per engine, rollouts stay a pure function of (weights, seeds)).

The log-probs and routes a response carries come from these forwards: the log-prob of each sampled token under the
logits it was sampled from (the raw model distribution: the numbers the trainer's forward gives for that token at
the same weights, to float rounding: two implementations of one network) and, per position, the routed experts of
the forward that fed it (SGLang's routed_experts: position p < n-1). No separate scoring forward.

Weight updates (async schedules) can land between two decode steps of a request: every token is stamped with the
version it was sampled under and keeps the log-prob it was sampled with (the behaviour policy's). A cache built
under old weights is never extended with new ones: the first step after an update re-runs the prefill over every
position the rows already hold, under the new weights, so tokens sampled after the update see a context computed
entirely by the new weights, and the routes (and prompt log-probs) a response returns are its last weights'. Meant
for CPU runs and tests; GPU clusters use SGLang.

These are SGLang's semantics under the trainer's pause_generation(mode="retract") (mpo.weight_sync.transports:
PAUSE_MODE; docs/weight_updates_in_flight.md): SGLang retracts the running requests to its queue, the update flushes
its radix cache, and on continue it prefills them again under the new weights; its meta_info.weight_versions spans
give each token's version. The pause rules are SGLang's too (pause): after an "in_place" pause the running rows keep
their cache and a flush, or an update that asks for one, is refused while they are there (can_flush), so a trainer
that would mix old KV with new weights on SGLang fails here as well.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from mpo.rollout.protocol import SamplingParams, check_token_ids, compact_routes

GONE_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class BatchModel(Protocol):
    """What the generator needs of a model (mpo.engine.model.EngineModel; tests fake it)."""

    def prefill(self, ids: torch.Tensor, *, capacity: int, want_routes: bool) -> tuple[Any, torch.Tensor, Any]:
        """ids [b, n] host -> (cache, logits [b, n, V] fp32, routes [b, n, L, K] host or None)."""

    def decode(self, cache: Any, ids: torch.Tensor, *, want_routes: bool) -> tuple[torch.Tensor, Any]:
        """ids [b] host, the tokens at the cache's next position -> (logits [b, 1, V] fp32, routes or None)."""

    def keep_rows(self, cache: Any, rows: list[int]) -> None:
        """Keep only these rows of the cache, in this order."""


class _CallDone:
    """Set when every request of one submit_many is answered. Its caller waits on this once per call: waiting on each
    request's own event woke the caller once per row, and every wake-up passed the GIL to it and back while the
    engine's thread was answering the rest of the batch (a sixth of a demo batch's time in the engine)."""

    def __init__(self, count: int) -> None:
        self.left, self.lock, self.event = count, threading.Lock(), threading.Event()
        self.answered: set[int] = set()  # id() of each request counted: once, whichever thread answers it (or both)
        if count == 0:
            self.event.set()

    def one_done(self, request_id: int) -> None:
        with self.lock:
            if request_id in self.answered:
                return
            self.answered.add(request_id)
            self.left -= 1
            if self.left == 0:
                self.event.set()


@dataclass
class _Active:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    want_routes: bool
    generator: torch.Generator | None
    logprob_start_len: int = -1  # SGLang's: >= 0 returns input_token_logprobs of the prompt from that position
    call: int = 0  # the submit_many it came in: a batch never mixes calls
    output: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the weight version each output token was sampled under
    sampled_logprobs: list[float] = field(default_factory=list)  # each output token's log-prob when it was sampled
    prompt_logprobs: dict[int, float] = field(default_factory=dict)  # position -> log-prob (logprob_start_len >= 0)
    retractions: int = 0  # retracting pauses while it ran (SGLang's meta_info.num_retractions)
    finish_reason: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    call_done: _CallDone | None = None  # its submit_many's, told when this request is answered
    response: dict[str, Any] | None = None
    started: float = field(default_factory=time.time)

    def token(self, position: int) -> int:
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.output[position - n]


@dataclass
class _Batch:
    """Rows decoding together: every row holds the same number of cached positions (`fed`)."""

    rows: list[_Active]
    capacity: int  # positions the cache is allocated for: the longest prompt + max_new_tokens
    want_routes: bool
    cache: Any = None
    version: str | None = None  # the weights the cache was computed under
    fed: int = 0  # positions in the cache; every row knows its token at position `fed` once a step is done
    routes: torch.Tensor | None = None  # [b, capacity, L, K] int32: the routes of every fed position

    @classmethod
    def of(cls, rows: list[_Active]) -> "_Batch":
        return cls(rows, max(len(r.prompt) + r.sampling.max_new_tokens for r in rows), any(r.want_routes for r in rows))

    def known(self) -> int:
        """Positions every row knows the token of (what a prefill can feed): all fed ones and the next, or the
        shortest prompt before the first step."""
        return max(self.fed + 1, min(len(r.prompt) for r in self.rows))

    def keep(self, model: BatchModel, index: list[int]) -> None:
        self.rows = [self.rows[i] for i in index]
        if self.cache is not None:
            model.keep_rows(self.cache, index)
        if self.routes is not None:
            self.routes = self.routes[index]


def _distributions(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Rows of fp32 logits [b, V] -> float64 sampling probabilities: temperature, then top_k, then nucleus (top_p)
    (the most likely token always kept), for rows that share one set of sampling parameters."""
    scaled = logits.double() / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
    return probs


def _sample_rows(logits: torch.Tensor, rows: list[_Active]) -> list[int | Exception]:
    """One token per row from host fp32 logits [b, V]: the distributions are computed per group of rows sharing
    sampling parameters (one batched op each, not a Python loop over tokens); each row then draws from its own
    generator (a seeded request gives the same tokens whatever batch it is in)."""
    broken = (logits.isnan().any(-1) | logits.isposinf().any(-1)).tolist()  # NaN or +inf: fails its own request
    out: list[int | Exception] = [FloatingPointError("the model produced non-finite logits")] * len(rows)
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        if not broken[i]:
            s = row.sampling
            groups.setdefault((s.greedy, s.temperature, s.top_k, s.top_p), []).append(i)
    for members in groups.values():
        sampling = rows[members[0]].sampling
        index = torch.tensor(members)
        if sampling.greedy:
            for i, token in zip(members, logits[index].argmax(-1).tolist()):
                out[i] = token
            continue
        probs = _distributions(logits[index], sampling)
        # torch.multinomial(p, 1) is argmax(p / q) with q ~ Exp(1) drawn from the generator (torch's own kernel for
        # one sample without replacement): the same draws per row, one batched division and argmax for all rows
        # (a multinomial call per row was a sixth of the engine's time on the demo).
        noise = torch.empty_like(probs)
        for k, i in enumerate(members):
            noise[k].exponential_(1, generator=rows[i].generator)
        for i, token in zip(members, (probs / noise).argmax(-1).tolist()):
            out[i] = token
    return out


class MpoGenerator:
    """Schedules generate requests on one model; thread-safe `submit` returns SGLang-shaped response dicts."""

    def __init__(self, model: BatchModel, *, vocab_size: int, max_batch: int = 16,
                 weight_version: str = "default", num_experts: int | None = None) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.num_experts = num_experts  # the routes' compact dtype (uint8 up to 256); None: from the values
        self.max_batch = max_batch
        self.weight_version = weight_version
        self.model_lock = threading.RLock()  # held for every model use: decode steps and weight updates
        self._pending: list[_Active] = []
        self._active: list[_Active] = []  # the running batch's rows
        self._cv = threading.Condition()
        self._paused = False
        self._retracted = False  # a retracting pause came: the running batch is prefilled again before its next step
        self._stopped = False
        self._ids = itertools.count()
        self._calls = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="mpo-engine-scheduler", daemon=True)
        self._thread.start()

    # -- requests ----------------------------------------------------------------------------------------------
    def submit(self, input_ids: list[int], sampling: SamplingParams, *, routed_experts: bool = False,
               rid: str | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        return self.submit_many([input_ids], [sampling], routed_experts=routed_experts,
                                rids=None if rid is None else [rid], timeout_s=timeout_s)[0]

    def submit_many(self, rows: list[list[int]], sampling: list[SamplingParams], *, routed_experts: bool = False,
                    rids: list[str] | None = None, timeout_s: float | None = None,
                    logprob_start_len: int = -1, gone: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
        """Queue rows together, in order (one batched /generate): the schedule, and so the numerics, is then the
        same on every run. Rows are checked before any is queued (ValueError), so a bad one never joins a batch.
        `gone`: polled while waiting; once it says the caller went away, the rows still queued or running are
        aborted (no one would read them) and their answers are returned as they stand."""
        requests = []
        call, all_done = next(self._calls), _CallDone(len(rows))
        for i, (input_ids, params) in enumerate(zip(rows, sampling, strict=True)):
            check_token_ids(input_ids, where=f"input_ids[{i}]" if len(rows) > 1 else "input_ids",
                            vocab_size=self.vocab_size)
            seed = params.sampling_seed
            generator = None if seed is None else torch.Generator().manual_seed(int(seed))
            name = rids[i] if rids else f"mpo-{next(self._ids)}"
            requests.append(_Active(name, list(input_ids), params, routed_experts, generator, logprob_start_len,
                                    call, call_done=all_done))
        with self._cv:
            self._pending.extend(requests)
            self._cv.notify_all()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if gone is not None:
                left = GONE_POLL_S if left is None else min(GONE_POLL_S, left)
            if all_done.event.wait(left):
                break
            if gone is not None and gone():
                self._cancel(requests, "the client went away")
                return [r.response for r in requests]
            if deadline is not None and time.monotonic() >= deadline:
                late = next(r for r in requests if not r.done.is_set())
                raise TimeoutError(f"request {late.rid} did not finish in {timeout_s} s")
        return [request.response for request in requests]

    def _cancel(self, requests: list[_Active], why: str) -> None:
        """Abort these requests wherever they are (queued, running or done)."""
        mine = {id(r) for r in requests}
        with self._cv:
            self._pending = [r for r in self._pending if id(r) not in mine]
            self._active = [r for r in self._active if id(r) not in mine]
        for request in requests:
            if request.finish_reason is None:
                request.finish_reason = {"type": "abort", "message": why}
            self._finish(request, score=False)

    def abort_all(self) -> int:
        with self._cv:
            victims = self._pending + self._active
            self._pending, self._active = [], []
        for request in victims:
            request.finish_reason = {"type": "abort", "message": "aborted by /abort_request"}
            self._finish(request, score=False)
        return len(victims)

    def busy(self) -> bool:
        with self._cv:
            return bool(self._pending or self._active)

    def pause(self, mode: str = "in_place") -> None:
        """Stop between two steps (SGLang's pause_generation; "abort" is the server's: abort_all, then this). "retract"
        drops the running rows' cache, rebuilt by a prefill on continue; "in_place" keeps it, the rows counting as
        running (can_flush); both as SGLang does (the module docstring)."""
        with self._cv:
            self._paused = True
            if mode == "retract" and self._active:
                self._retracted = True
                for request in self._active:
                    request.retractions += 1

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def can_flush(self) -> bool:
        """SGLang's flush rule (Scheduler.flush_cache: is_fully_idle, queued requests ignored while paused): True
        unless a request is running (a batch not retracted) or, while not paused, queued."""
        with self._cv:
            running = bool(self._active) and not self._retracted
            return not running and (self._paused or not self._pending)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self.abort_all()

    # -- scheduling --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        batch: _Batch | None = None
        while True:
            with self._cv:
                while not self._stopped and (self._paused or not (self._pending or self._active)):
                    self._cv.wait()
                if self._stopped:
                    return
                if not self._active:  # a new batch: the first queued call's rows (a call's rows queue together)
                    call = self._pending[0].call
                    n = 0
                    while n < min(self.max_batch, len(self._pending)) and self._pending[n].call == call:
                        n += 1
                    self._active = self._pending[:n]
                    del self._pending[:n]
                    batch = _Batch.of(list(self._active))
                elif self._retracted and batch is not None:
                    batch.cache = None  # retracted: recomputed by the next step's prefill, under today's weights
                self._retracted = False
            try:
                self._step(batch)
            except Exception as exc:  # noqa: BLE001 - last resort: the scheduler thread must never die
                for request in batch.rows:
                    self._fail(request, exc)

    def _step(self, batch: _Batch) -> None:
        """One forward for the batch (the prefill, or a decode step) and a token for each row. If the forward
        fails, each row is tried alone, so a failure aborts only the requests it belongs to; the others go on."""
        with self.model_lock, torch.no_grad():
            alive = [i for i, r in enumerate(batch.rows) if r.finish_reason is None]
            if len(alive) < len(batch.rows):
                batch.keep(self.model, alive)
            if not batch.rows:
                return
            version = self.weight_version  # updates apply under model_lock: this is the version of these logits
            try:
                first, logits = self._forward(batch, version)
            except Exception as exc:  # noqa: BLE001 - isolate below
                self._isolate(batch, exc)
                return
            self._take_tokens(batch, first, logits, version)
        done = [(i, r) for i, r in enumerate(batch.rows) if r.finish_reason is not None]
        if done:
            with self._cv:
                self._active = [r for r in self._active if r.finish_reason is None]
            for i, request in done:
                self._finish(request, score=True, routes=self._routes_of(batch, i))

    def _forward(self, batch: _Batch, version: str) -> tuple[int, torch.Tensor]:
        """Feed the batch's next position(s): (first position fed, logits of the fed positions [b, n, V])."""
        if batch.cache is None or batch.version != version:
            # A new batch, or weights changed since its cache was computed: prefill every position all rows know.
            n = batch.known()
            ids = torch.tensor([[r.token(p) for p in range(n)] for r in batch.rows])
            batch.cache = None  # an old cache is never extended with new weights
            batch.cache, logits, routes = self.model.prefill(ids, capacity=batch.capacity,
                                                             want_routes=batch.want_routes)
            first = 0
        else:
            first = batch.fed
            ids = torch.tensor([r.token(first) for r in batch.rows])
            logits, routes = self.model.decode(batch.cache, ids, want_routes=batch.want_routes)
        batch.version, batch.fed = version, first + logits.shape[1]
        if routes is not None:
            if self.num_experts is not None:  # the answer's compact dtype, checked once per step (not once per row)
                routes = torch.from_numpy(compact_routes(routes.cpu().numpy(), self.num_experts))
            if batch.routes is None:
                batch.routes = torch.zeros((len(batch.rows), batch.capacity, *routes.shape[2:]), dtype=routes.dtype)
            batch.routes[:, first:batch.fed] = routes
        return first, logits

    def _take_tokens(self, batch: _Batch, first: int, logits: torch.Tensor, version: str) -> None:
        """Logits at position p score the token at p + 1: the prompt tokens' log-probs where a request asked for
        them, and, for rows past their prompt, the next token sampled from the last position."""
        wants_prompt = [i for i, r in enumerate(batch.rows) if r.logprob_start_len >= 0]
        if wants_prompt:  # rare (SGLang's logprob_start_len): the whole block to the host
            logp = torch.log_softmax(logits[wants_prompt].double(), -1).cpu()
            for k, i in enumerate(wants_prompt):
                row = batch.rows[i]
                for p in range(max(first + 1, row.logprob_start_len, 1), min(batch.fed + 1, len(row.prompt))):
                    row.prompt_logprobs[p] = float(logp[k, p - 1 - first, row.prompt[p]])
        # Each row's last position, on the model's device, then to the host in one copy: sampling runs on the host
        # with each request's CPU generator, so a seed gives the same tokens whatever device the model is on.
        last = logits[:, -1].cpu()
        sampling = [i for i, r in enumerate(batch.rows)  # past its prompt, and not aborted while the forward ran
                    if batch.fed >= len(r.prompt) and r.finish_reason is None]
        if not sampling:
            return
        rows = [batch.rows[i] for i in sampling]
        tokens = _sample_rows(last[sampling], rows)
        # the behaviour policy's log-prob (raw model distribution, as the trainer's forward gives it), gathered for
        # every row at once (not an indexing call per row, per token)
        picked = torch.tensor([0 if isinstance(token, Exception) else token for token in tokens])
        logprobs = torch.log_softmax(last[sampling].double(), -1).gather(1, picked[:, None]).squeeze(1).tolist()
        for request, token, logprob in zip(rows, tokens, logprobs):
            if isinstance(token, Exception):
                request.finish_reason = {"type": "abort", "message": f"engine error: {type(token).__name__}: {token}"}
                continue
            request.output.append(token)
            request.versions.append(version)
            request.sampled_logprobs.append(logprob)
            if token in request.sampling.stop_token_ids:
                request.finish_reason = {"type": "stop", "matched": token}
            elif len(request.output) >= request.sampling.max_new_tokens:
                request.finish_reason = {"type": "length", "length": len(request.output)}

    def _isolate(self, batch: _Batch, exc: Exception) -> None:
        """The batch's forward raised: prefill each row alone; rows that fail alone are aborted, the others are
        re-prefilled together at the next step. If none fails alone, the failure is the batch's: all are aborted."""
        failed = []
        if len(batch.rows) > 1:
            n = batch.known()
            for request in batch.rows:
                try:
                    self.model.prefill(torch.tensor([[request.token(p) for p in range(n)]]), capacity=batch.capacity,
                                       want_routes=batch.want_routes)
                except Exception as alone:  # noqa: BLE001 - this request's failure, not the server's
                    failed.append((request, alone))
        if not failed:
            failed = [(request, exc) for request in batch.rows]
        for request, error in failed:
            request.finish_reason = {"type": "abort", "message": f"engine error: {type(error).__name__}: {error}"}
        batch.cache = None  # the survivors' cache is rebuilt by the next step's prefill
        with self._cv:
            self._active = [r for r in self._active if r.finish_reason is None]
        for request, _ in failed:
            self._finish(request, score=False)

    @staticmethod
    def _routes_of(batch: _Batch, i: int) -> Any:
        """SGLang's routed_experts: row p = routing of the token at input position p, for p < n-1, all layers."""
        request = batch.rows[i]
        if not request.want_routes or batch.routes is None:
            return None
        return batch.routes[i, : len(request.prompt) + len(request.output) - 1].numpy()

    def _fail(self, request: _Active, exc: BaseException) -> None:
        request.finish_reason = {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"}
        with self._cv:
            self._active = [r for r in self._active if r is not request]
        self._finish(request, score=False)

    def _finish(self, request: _Active, *, score: bool, routes: Any = None) -> None:
        if request.done.is_set():
            return  # answered already (aborted while its step ran)
        n_prompt = len(request.prompt)
        score = score and request.finish_reason is not None and request.finish_reason.get("type") != "abort"
        meta: dict[str, Any] = {
            "id": request.rid, "finish_reason": request.finish_reason, "prompt_tokens": n_prompt,
            "completion_tokens": len(request.output), "cached_tokens": 0, "num_retractions": request.retractions,
            "weight_version": self.weight_version, "e2e_latency": time.time() - request.started}
        completion_logprobs = request.sampled_logprobs if score else [0.0] * len(request.output)
        meta["output_token_logprobs"] = [[float(lp), int(tok), None]
                                         for lp, tok in zip(completion_logprobs, request.output)]
        meta["output_token_logprobs_length"] = len(request.output)
        # mpo extension (SGLang has no such field): weights can change mid-request (an async run's in-flight update)
        meta["output_token_weight_versions"] = list(request.versions)
        # SGLang's shape: [logprob, token_id, text] per prompt token from logprob_start_len; position 0 has no logprob.
        start = request.logprob_start_len
        meta["input_token_logprobs"] = [[request.prompt_logprobs.get(p) if score and p > 0 else None,
                                         int(request.prompt[p]), None]
                                        for p in range(max(start, 0), n_prompt)] if start >= 0 else []
        if score and request.want_routes and routes is not None:
            # compact [tokens, MoE layers, top_k] (uint8 up to 256 experts); the server writes it as raw bytes or,
            # for SGLang's JSON, as base64 int32 (mpo.rollout.frames)
            meta["routed_experts"] = (routes if self.num_experts is not None  # compacted and checked per step
                                      else compact_routes(routes, self.num_experts))
        request.response = {"text": "", "output_ids": list(request.output), "meta_info": meta}
        request.done.set()
        if request.call_done is not None:
            request.call_done.one_done(id(request))
