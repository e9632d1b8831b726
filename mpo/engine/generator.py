"""mpo's own generation engine: the mpo model (megatron-core GPTModel, TP1 in this process) behind SGLang's API.

Continuous batching without a KV cache: each decode step re-runs the (tiny) model over the right-padded active rows
and samples the next token from each row's last position. When a request finishes, its prompt+completion is scored
by the same forward path the trainer uses (mpo.models.forward.run_microbatches), so the log-probs it returns equal
the trainer's log-probs of those tokens at the same weights. A weight update can land between two decode steps of a
request (async schedules): every token is stamped with the version it was sampled under, and a token sampled under
weights that are gone when the response is scored gets the log-prob it had when it was sampled (the behaviour
policy's), not the new weights'. Meant for CPU runs and tests; GPU clusters use SGLang.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mpo.rollout.protocol import SamplingParams, check_token_ids

GONE_POLL_S = 0.25  # how often a waiting request checks that its client is still there

# Per finished request: (prompt+completion ids) -> (logprobs of every token [n], routed experts [n-1, L, K] or None)
Scorer = Callable[[list[list[int]], bool], list[tuple[list[float], Any]]]


@dataclass
class _Active:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    want_routes: bool
    generator: torch.Generator | None
    logprob_start_len: int = -1  # SGLang's: >= 0 returns input_token_logprobs of the prompt from that position
    output: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the weight version each output token was sampled under
    sampled_logprobs: list[float] = field(default_factory=list)  # each output token's log-prob when it was sampled
    finish_reason: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    response: dict[str, Any] | None = None
    started: float = field(default_factory=time.time)


def sample_next(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at (near-)zero temperature, else temperature + top_k + nucleus (top_p) sampling from fp32 logits [V].
    Raises FloatingPointError on NaN/+inf logits (a broken row must fail its own request, not yield a token)."""
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise FloatingPointError("the model produced non-finite logits")
    if sampling.greedy:
        return int(logits.argmax())
    scaled = logits.double() / sampling.temperature
    if 0 < sampling.top_k < scaled.numel():
        kth = scaled.topk(sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class MpoGenerator:
    """Schedules generate requests on one model; thread-safe `submit` returns SGLang-shaped response dicts."""

    def __init__(self, logits_fn: Callable[[torch.Tensor], torch.Tensor], scorer: Scorer, *, vocab_size: int,
                 max_batch: int = 16, weight_version: str = "default", num_experts: int | None = None) -> None:
        self.logits_fn = logits_fn  # [b, s] host ids -> [b, s, V] fp32 logits of the real vocabulary (any device)
        self.scorer = scorer
        self.vocab_size = vocab_size
        self.num_experts = num_experts  # the routes' compact dtype (uint8 up to 256); None: from the values
        self.max_batch = max_batch
        self.weight_version = weight_version
        self.model_lock = threading.RLock()  # held for every model use: decode steps, scoring, weight updates
        self._pending: list[_Active] = []
        self._active: list[_Active] = []
        self._cv = threading.Condition()
        self._paused = False
        self._stopped = False
        self._ids = itertools.count()
        self._seed_stream = torch.Generator().manual_seed(0)
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
        for i, (input_ids, params) in enumerate(zip(rows, sampling, strict=True)):
            check_token_ids(input_ids, where=f"input_ids[{i}]" if len(rows) > 1 else "input_ids",
                            vocab_size=self.vocab_size)
            generator = None
            if params.sampling_seed is not None:
                generator = torch.Generator().manual_seed(int(params.sampling_seed))
            name = rids[i] if rids else f"mpo-{next(self._ids)}"
            requests.append(_Active(name, list(input_ids), params, routed_experts, generator, logprob_start_len))
        with self._cv:
            self._pending.extend(requests)
            self._cv.notify_all()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for request in requests:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if gone is not None:
                    left = GONE_POLL_S if left is None else min(GONE_POLL_S, left)
                if request.done.wait(left):
                    break
                if gone is not None and gone():
                    self._cancel(requests, "the client went away")
                    return [r.response for r in requests]
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"request {request.rid} did not finish in {timeout_s} s")
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

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self.abort_all()

    # -- scheduling --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._paused or not (self._pending or self._active)):
                    self._cv.wait()
                if self._stopped:
                    return
                room = self.max_batch - len(self._active)
                self._active.extend(self._pending[:room])
                del self._pending[:room]
                batch = list(self._active)
            try:
                self._step(batch)
                finished = [r for r in batch if r.finish_reason is not None and not r.done.is_set()]
                if finished:
                    with self._cv:
                        self._active = [r for r in self._active if r.finish_reason is None]
                    self._score_and_finish(finished)
            except Exception as exc:  # noqa: BLE001 - last resort: the scheduler thread must never die
                for request in batch:
                    self._fail(request, exc)

    def _step(self, batch: list[_Active]) -> None:
        """One decode step. If the batched forward fails, each row is retried alone, so a failure aborts only the
        requests it belongs to; the others keep generating."""
        try:
            self._decode_step(batch)
            return
        except Exception as exc:  # noqa: BLE001 - isolate below
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
        for request in batch:
            try:
                self._decode_step([request])
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the server's
                self._fail(request, exc)

    def _fail(self, request: _Active, exc: BaseException) -> None:
        request.finish_reason = {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"}
        with self._cv:
            self._active = [r for r in self._active if r is not request]
        self._finish(request, score=False)

    def _decode_step(self, batch: list[_Active]) -> None:
        rows = [r.prompt + r.output for r in batch]
        lengths = [len(row) for row in rows]
        ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        with self.model_lock, torch.no_grad():
            logits = self.logits_fn(ids)
            version = self.weight_version  # updates apply under model_lock: this is the version of these logits
            # Each row's last position, on the model's device, then to the host in one copy: sampling runs on the
            # host with each request's CPU generator, so a seed gives the same tokens whatever device the model is on.
            rows_index = torch.arange(len(rows), device=logits.device)
            last = logits[rows_index, torch.tensor(lengths, device=logits.device) - 1].cpu()
        for i, request in enumerate(batch):
            if request.finish_reason is not None:
                continue  # aborted meanwhile
            try:
                token = sample_next(last[i], request.sampling, request.generator)
            except Exception as exc:  # noqa: BLE001 - fails this request only; the batch goes on
                self._fail(request, exc)
                continue
            request.output.append(token)
            request.versions.append(version)
            # the behaviour policy's log-prob (raw model distribution, as the scorer's): kept for tokens whose
            # weights are gone by the time the response is scored (an update arrived mid-response)
            request.sampled_logprobs.append(float(last[i, token].double() - torch.logsumexp(last[i].double(), -1)))
            if token in request.sampling.stop_token_ids:
                request.finish_reason = {"type": "stop", "matched": token}
            elif len(request.output) >= request.sampling.max_new_tokens:
                request.finish_reason = {"type": "length", "length": len(request.output)}

    def _score_and_finish(self, finished: list[_Active]) -> None:
        """Score finished requests together; if that fails, one by one, so only a failing request is aborted."""
        try:
            scores = self._score(finished)
        except Exception as exc:  # noqa: BLE001 - isolate below
            if len(finished) == 1:
                self._fail(finished[0], exc)
                return
            for request in finished:
                self._score_and_finish([request])
            return
        scores, version = scores
        for request, (logprobs, routes) in zip(finished, scores):
            n_prompt = len(request.prompt)
            for t, sampled_under in enumerate(request.versions):
                if sampled_under != version:  # sampled before an update: the weights that scored it are not its own
                    logprobs[n_prompt + t] = request.sampled_logprobs[t]
            self._finish(request, score=True, logprobs=logprobs, routes=routes)

    def _score(self, finished: list[_Active]) -> tuple[list[tuple[list[float], Any]], str]:
        """The finished rows scored by the scorer, and the weight version that scored them."""
        want_routes = any(r.want_routes for r in finished)
        with self.model_lock, torch.no_grad():
            return self.scorer([r.prompt + r.output for r in finished], want_routes), self.weight_version

    def _finish(self, request: _Active, *, score: bool, logprobs: list[float] | None = None,
                routes: Any = None) -> None:
        from mpo.rollout.protocol import compact_routes

        if request.done.is_set():
            return  # answered already (aborted while its step ran)
        n_prompt = len(request.prompt)
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": request.finish_reason,
            "prompt_tokens": n_prompt,
            "completion_tokens": len(request.output),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.time() - request.started,
        }
        completion_logprobs = logprobs[n_prompt:] if (score and logprobs is not None) else [0.0] * len(request.output)
        meta["output_token_logprobs"] = [[float(lp), int(tok), None]
                                         for lp, tok in zip(completion_logprobs, request.output)]
        meta["output_token_logprobs_length"] = len(request.output)
        # mpo extension (SGLang has no such field): weights can change mid-request (an async run's in-flight update)
        meta["output_token_weight_versions"] = list(request.versions)
        # SGLang's shape: [logprob, token_id, text] per prompt token from logprob_start_len; position 0 has no logprob.
        start = request.logprob_start_len
        meta["input_token_logprobs"] = [[None if p == 0 or not score else float(logprobs[p]), int(request.prompt[p]),
                                         None] for p in range(max(start, 0), n_prompt)] if start >= 0 else []
        if request.want_routes and routes is not None:
            # compact [tokens, MoE layers, top_k] (uint8 up to 256 experts); the server writes it as raw bytes or,
            # for SGLang's JSON, as base64 int32 (mpo.rollout.frames)
            meta["routed_experts"] = compact_routes(routes, self.num_experts)
        request.response = {"text": "", "output_ids": list(request.output), "meta_info": meta}
        request.done.set()
