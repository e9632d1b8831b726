"""Many engines at once (data parallel): async requests, bounded concurrency, retries with backoff, and restart of
an engine that dies or hangs, without losing or duplicating a sample.

Requests go out in calls of `requests_per_call` consecutive requests (one batched /generate each), at most
`max_concurrency_per_engine` calls in flight per engine; a call that fails is re-sent whole (the other calls are not
touched), and `on_call` hears of each call as its answers land, while the others are still generating.

Exactly-once: every request has a slot; a slot is filled by the first successful response and never again. A request
whose engine failed (connection error, 5xx, timeout) goes back to the queue and is retried on a healthy engine; an
engine that failed is health-checked and, if it is down, restarted through its EngineHandle before it takes work
again. 4xx answers are the request's fault and are raised at once, naming the engine. A malformed answer is an engine
failure (mpo.rollout.client) and is retried like a 5xx.

No dead workers: anything else a worker meets (a bug, an engine restart that raises) ends the whole rollout at once
with a RolloutFailed naming the engine and the error, instead of leaving that worker's call unanswered and every
other worker waiting for it forever. The errors a rollout ends with (EngineError, RolloutFailed) are one line each,
and rollout_failure finds them behind a run's error, where the trainer stops with that line (mpo.trainer.__main__).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from mpo.rollout.client import EngineClient, EngineError
from mpo.rollout.protocol import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)


class RolloutFailed(RuntimeError):
    """The rollout cannot finish: no healthy engine is left, or a worker met an error that is no engine's answer."""


class StaleEngines(RolloutFailed):
    """Requests left undone: the engines that could take them were restarted, waiting for the current weights."""


def rollout_failure(exc: BaseException) -> BaseException | None:
    """The engine or rollout failure (EngineError, RolloutFailed) behind `exc`: itself or an exception it was raised
    from (`raise ... from`: a rollout producer's error reaches rank 0 as a RuntimeError raised from it,
    mpo.trainer.producer); None if there is none. Its message is the one line a run ends with. An error merely met
    while one propagated (__context__, e.g. in a clean-up) is not it: that error keeps its traceback."""
    current: BaseException | None = exc
    for _ in range(16):  # a chain is a few links long; a cycle must not loop forever
        if current is None:
            return None
        if isinstance(current, (EngineError, RolloutFailed)):
            return current
        current = current.__cause__
    return None


@dataclass
class EngineHandle:
    """An engine the pool may use, and how to bring it back if it dies (None: it cannot be restarted by us)."""

    client: EngineClient
    restart: Callable[[], None] | None = None
    current: Callable[[], bool] | None = None  # may it take work now (False: restarted, no current weights yet)?
    restarts: int = 0
    _lock: asyncio.Lock | None = field(default=None, repr=False)
    _ready: asyncio.Event | None = field(default=None, repr=False)  # clear while a failure is being recovered from
    _gone: bool = field(default=False, repr=False)  # down and not restartable: its workers stop


@dataclass(frozen=True)
class PoolConfig:
    """Rollout pool behaviour.

    Attributes:
        max_concurrency_per_engine: calls in flight per engine.
        request_timeout_s: a request slower than this counts as a hung engine.
        max_attempts: tries per request before the rollout fails.
        backoff_s: first retry delay; doubles per attempt.
        max_restarts_per_engine: restarts before an engine is given up on.
    """

    max_concurrency_per_engine: int = 8
    request_timeout_s: float = 300.0
    max_attempts: int = 4
    backoff_s: float = 0.5
    max_restarts_per_engine: int = 3


OnCall = Callable[[list[int], list[GenerateResult], str], None]  # (request indices, their results, engine url)


@dataclass(frozen=True)
class Resent:
    """A call put back in the queue after its engine failed: which engine, its request indices, the failed try."""

    url: str
    indices: tuple[int, ...]
    attempt: int


class RolloutPool:
    """Spreads generate requests over engines; results come back in request order, each exactly once.

    `resent` lists the calls the last generate re-sent after a failure (Resent), `calls` how many calls it sent
    (each try counts)."""

    def __init__(self, engines: Sequence[EngineHandle], config: PoolConfig = PoolConfig()) -> None:
        if not engines:
            raise ValueError("rollout pool needs at least one engine")
        self.engines = list(engines)
        self.config = config
        self.resent: list[Resent] = []
        self.calls = 0

    def generate(self, requests: Sequence[GenerateRequest], *, requests_per_call: int = 1,
                 on_call: OnCall | None = None) -> list[GenerateResult]:
        """Every request's result, in request order; `requests_per_call` requests go in one batched /generate call
        (all of an engine's requests in one call: its batching is deterministic, bit-exact reruns on CPU).
        `on_call(indices, results, url)` runs (on this thread, between the event loop's steps: keep it short, hand
        slow work to another thread) once per call, when its results have landed, each request's exactly once."""
        # A plain loop, not asyncio.run: on the main thread asyncio.run (Python 3.12.1) ends by formatting the repr of
        # its SIGINT handler, which holds the finished task, so every call printed its results' arrays (~10 ms).
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(self.agenerate(requests, requests_per_call=requests_per_call,
                                                          on_call=on_call))
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def agenerate(self, requests: Sequence[GenerateRequest], *, requests_per_call: int = 1,
                        on_call: OnCall | None = None) -> list[GenerateResult]:
        results: list[GenerateResult | None] = [None] * len(requests)
        queue: asyncio.Queue[tuple[list[int], int] | None] = asyncio.Queue()
        per_call = max(1, requests_per_call)
        for start in range(0, len(requests), per_call):
            queue.put_nowait((list(range(start, min(start + per_call, len(requests)))), 0))
        self.resent, self.calls = [], 0
        for engine in self.engines:  # restarts count per call: each call has the whole restart budget
            engine._lock, engine.restarts = asyncio.Lock(), 0
            engine._ready, engine._gone = asyncio.Event(), False
            engine._ready.set()
        failure: list[BaseException] = []
        n_workers = len(self.engines) * self.config.max_concurrency_per_engine
        # Calls not answered yet, queued or in flight: an idle worker waits for them (a failed call comes back to the
        # queue) and all end when none is left.
        left = [queue.qsize()]

        def answered() -> None:
            left[0] -= 1
            if left[0] == 0:
                for _ in range(n_workers):
                    queue.put_nowait(None)

        if not left[0]:
            left[0] = 1
            answered()

        async def worker(engine: EngineHandle) -> None:
            try:
                await serve(engine)
            except Exception as exc:  # noqa: BLE001 - anything else ends the rollout (the module's docstring)
                frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
                where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
                error = RolloutFailed(f"rollout: {type(exc).__name__}{where} with engine {engine.client.url}: "
                                      + " ".join(str(exc).split()))  # one line
                error.__cause__ = exc
                failure.append(error)

        async def serve(engine: EngineHandle) -> None:
            assert engine._ready is not None
            while not failure:
                # After a failure an engine takes no work until it is recovered: its other idle workers would
                # otherwise burn the failed call's attempts on it before the restart.
                await engine._ready.wait()
                if engine._gone or not self._current(engine):  # restarted: stale until a weight sync reaches it
                    return
                item = await queue.get()
                if item is None:
                    return
                if not engine._ready.is_set() or engine._gone:  # it failed while this worker waited for work
                    queue.put_nowait(item)
                    queue.task_done()
                    continue
                indices, attempt = item
                try:
                    self.calls += 1
                    answers = await engine.client.generate_batch([requests[i] for i in indices],
                                                                 timeout_s=self.config.request_timeout_s)
                    fresh = [(index, result) for index, result in zip(indices, answers) if results[index] is None]
                    for index, result in fresh:  # first answer wins; a late duplicate is dropped
                        results[index] = result
                    if fresh:
                        answered()
                    if on_call is not None and fresh:
                        try:
                            on_call([i for i, _ in fresh], [r for _, r in fresh], engine.client.url)
                        except Exception as exc:  # noqa: BLE001 - the caller's error ends the rollout, raised below
                            failure.append(exc)
                            return
                except EngineError as exc:
                    if not exc.retryable:
                        failure.append(exc)
                        return
                    if attempt + 1 >= self.config.max_attempts:
                        failure.append(EngineError(exc.url, exc.endpoint, f"gave up after {attempt + 1} attempts: "
                                                   f"{exc}"))
                        return
                    log.warning("rollout requests %s failed (%s); retrying", indices, exc)
                    engine._ready.clear()
                    self.resent.append(Resent(engine.client.url, tuple(indices), attempt))
                    queue.put_nowait((indices, attempt + 1))
                    await asyncio.sleep(self.config.backoff_s * 2**attempt)
                    recovered = await self._recover(engine)
                    engine._gone = engine._gone or not recovered or not self._current(engine)
                    engine._ready.set()  # its workers go on, or see it gone and stop
                    if not recovered:
                        return  # this engine is gone; the others take its work
                finally:
                    queue.task_done()

        workers = [asyncio.create_task(worker(engine)) for engine in self.engines
                   for _ in range(self.config.max_concurrency_per_engine)]
        try:
            pending = set(workers)  # woken by each worker's end, not by polling: a poll added up to 10 ms per batch
            while pending and not failure:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            for engine in self.engines:
                await engine.client.aclose()
        if failure:
            raise failure[0]
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            stale = ", ".join(e.client.url for e in self.engines if not self._current(e))
            raise (StaleEngines if stale else RolloutFailed)(
                f"rollout: no healthy engine left; {len(missing)} of {len(requests)} samples missing (engines: "
                f"{', '.join(e.client.url for e in self.engines)})"
                + (f"; restarted, waiting for the next weight sync: {stale}" if stale else ""))
        return results  # type: ignore[return-value]

    @staticmethod
    def _current(engine: EngineHandle) -> bool:
        return engine.current is None or engine.current()

    async def _recover(self, engine: EngineHandle) -> bool:
        """After a failure: if the engine does not answer health checks, restart it (once for all its workers)."""
        assert engine._lock is not None
        async with engine._lock:
            if engine._gone:  # another worker's recovery gave it up meanwhile
                return False
            if await asyncio.to_thread(engine.client.healthy, 10.0):
                return True
            if engine.restart is None or engine.restarts >= self.config.max_restarts_per_engine:
                log.error("engine %s is down and cannot be restarted", engine.client.url)
                return False
            log.warning("engine %s is down; restarting it", engine.client.url)
            engine.restarts += 1
            try:
                await asyncio.to_thread(engine.restart)
            except Exception as exc:  # noqa: BLE001 - a failed restart leaves it down: the others take its work
                log.error("engine %s could not be restarted: %s: %s", engine.client.url, type(exc).__name__, exc)
                engine._gone = True  # not restarted again by its other workers' recoveries
                return False
            return await asyncio.to_thread(engine.client.healthy, 60.0)
