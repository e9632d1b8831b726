"""When rollouts are generated relative to training: `schedule.mode` (sync, one_step_off, async).

* sync: step n generates with the weights of step n, then trains, then syncs (engines idle while the trainer works).
* one_step_off: a producer on rank 0 generates the batch of step n+1 while step n trains: a batch is started
  at version >= its step - 1 and the weight sync waits until the batch in flight is finished (updates reach the
  engines between requests), so every token is at most 1 version stale.
* async: the producer keeps the engines busy: it starts the batch of step p as soon as the engines hold version
  >= p - schedule.max_staleness, and the weight sync does not wait for it: the push pauses the engines retracting the
  requests in flight (pause_generation(mode="retract") in WeightSync.begin_session; docs/weight_updates_in_flight.md),
  swaps the weights, flushes the old-weight cache and continues, so a partial rollout is recomputed and finishes
  under the new weights. Every generated token is stamped with the weight version it was sampled under (mpo's
  engine: meta_info.output_token_weight_versions; SGLang: its meta_info.weight_versions spans); a token without a
  stamp gets the version current when its batch was submitted, the oldest it can have.

The consumer (the training step) takes the batch of its step and drops any sample with a token older than
step - max_staleness (the gate makes this a check that should never fire; `staleness_dropped_samples` counts it).
Staleness of a token consumed at step n is n - its version. Logged every step: staleness_max / staleness_mean
(over consumed tokens), engine_busy_frac (wall time of the step during which the engines were generating) and
overlap_frac (fraction of the trainer's busy time, train + sync, during which the engines were generating).
Rank 0 writes a summary of each consumed sample's versions to versions.jsonl (tokens, min, max, changes;
every token's version with logging.versions_per_token).

The engine log-probs of a stale sample come from an older policy (the behaviour policy, per token: mpo's engine keeps
each token's log-prob from when it was sampled, also across an in-flight update) than the trainer's old-logprob
forward (the proximal policy, at the current version). Off-policy modes therefore train with the decoupled objective
by default (mpo.algorithms.rollout_correction.OFF_POLICY_DEFAULT says what and why; without it, stale
negative-advantage tokens the current policy has all but ruled out enter the loss at full weight) and replay the routes
each sample was generated with (algorithm.replay unset -> r3: without replay the demo's MoE collapsed late).

Colocated engines (rollout.colocate, sync mode only): the engines share the trainer's GPUs, so after each batch
they release their memory (SGLang --enable-memory-saver: /release_memory_occupation) and take it back in two stages
around the weight sync: /resume_memory_occupation {"tags": ["weights"]}, the push, then {"tags": ["kv_cache"]}.
The trainer's side (rollout.offload_trainer; mpo.trainer.offload says what moves) is offloaded at the start of
Trainer.train_step, before rank 0 generates, and reloaded once the batch has arrived. One step is then: trainer
offloaded while the engines generate, engines release, trainer reloads and trains, engines resume their weights,
the push (reads the trainer's resident parameters), engines resume the KV cache. The warm start and the first push
run before the first step, resident. Real SGLang's release calls CUDA, so on CPU the GPU path is unverified.

The producer is a thread of rank 0 that keeps the gating below (versions, the one_step_off lock, busy intervals); in
the off-policy modes what it calls, `collect`, is a child process's (mpo.trainer.producer says why). Sync mode collects
in rank 0's own thread.

Resume: checkpoints are taken at step boundaries as in sync mode; batches generated ahead of the checkpoint are dropped
on a restart and regenerated (for toy tasks from the same prompts and seeds, but under whichever weights the engines
hold then: off-policy runs are not bit-reproducible, their timing decides the versions). Producer and trainer never
share a collective: the producer only talks HTTP to the engines and scores beside rank 0.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mpo.trainer.producer import ProducerDied

log = logging.getLogger(__name__)

MODES = ("sync", "one_step_off", "async")


def _overlap(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


@dataclass
class _Produced:
    samples: list
    metrics: dict[str, float]
    rows: list[dict]  # its samples.jsonl rows
    state: dict | None  # the rollout state right after it was drawn (off-policy; see RolloutSchedule.state)


@dataclass
class RolloutSchedule:
    """Rank 0's source of each step's samples; `collect(step, version)` generates and scores one step's batch.

    The training loop calls, per step: take(step) (inside train_step), before_sync() / after_sync(version) around
    the weight sync, step_metrics() after it, and stop() at the end.
    """

    collect: Callable[[int, int], tuple[list, dict[str, float]]]
    mode: str
    max_staleness: int
    start: int
    steps: int
    on_versions: Callable[[int, list[list[int]]], None] | None = None
    # Colocated engines (rollout.colocate, sync mode): memory(action, tags) releases the engines' GPU memory after
    # each batch and resumes it in two stages around the weight sync (weights first, then the KV cache).
    memory: Callable[[str, list[str] | None], None] | None = None
    # The collect source's rows for samples.jsonl of the batch it just made: read right after each collect, so the
    # rows logged with a step are that step's (off-policy, the source has moved on to the next batch by then).
    rows: Callable[[], list[dict]] | None = None
    samples_log: list[dict] = field(default_factory=list)  # the rows of the batch take() last returned
    # Off-policy, the rollout state (data position, retirement, advantages) read right after each collect: the
    # producer draws ahead of training, so at a checkpoint its own state already counts batches no step trained; a
    # resume from it would skip their prompts. A checkpoint keeps the state of the batch trained last instead, and the
    # resumed run draws the batches after it again.
    state: Callable[[], dict] | None = None
    taken_state: dict | None = None  # the state of the batch take() last returned (None: read the source's own)
    version: int = 0
    _batches: dict[int, _Produced] = field(default_factory=dict)
    _busy: list[tuple[float, float]] = field(default_factory=list)  # engine generating intervals (perf_counter)
    _generating: threading.Lock = field(default_factory=threading.Lock)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _error: BaseException | None = None
    _stopped: bool = False
    _thread: threading.Thread | None = None
    _trainer_from: float = 0.0  # when the trainer got its batch this step
    _step_from: float = 0.0  # when the previous step ended
    _batch_began: float = 0.0  # when the batch in flight was started

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"schedule.mode={self.mode!r}; valid values: {', '.join(MODES)}")
        self.version = self.start
        self._step_from = time.perf_counter()
        if self.mode != "sync":
            self._thread = threading.Thread(target=self._produce, name="mpo-rollout-producer", daemon=True)
            self._thread.start()

    @property
    def lag(self) -> int:
        """How many versions behind its step a batch may be started."""
        return 0 if self.mode == "sync" else 1 if self.mode == "one_step_off" else self.max_staleness

    # -- producer (a thread on rank 0; off-policy, `collect` is a child process's) -------------------------------
    def _generate(self, step: int) -> _Produced:
        with self._generating:
            began = self._batch_began = time.perf_counter()
            try:
                samples, metrics = self.collect(step, self.version)
                rows = list(self.rows()) if self.rows is not None else []
                state = self.state() if self.state is not None and self.mode != "sync" else None
            finally:
                with self._cv:
                    self._busy.append((began, time.perf_counter()))
        return _Produced(samples, metrics, rows, state)

    def _produce(self) -> None:
        try:
            for step in range(self.start, self.steps):
                with self._cv:
                    while not self._stopped and self.version < step - self.lag:
                        self._cv.wait()
                    if self._stopped:
                        return
                produced = self._generate(step)
                with self._cv:
                    self._batches[step] = produced
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it in take()
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    # -- consumer (the training step) ----------------------------------------------------------------------------
    def take(self, step: int) -> tuple[list, dict[str, float]]:
        """The samples of `step` no staler than the mode allows, with the batch's rollout metrics."""
        waited = time.perf_counter()
        if self.mode == "sync":
            produced = self._generate(step)
            if self.memory is not None:
                self.memory("release", None)  # the trainer gets the device while it trains
        else:
            with self._cv:
                while step not in self._batches and self._error is None:
                    self._cv.wait(timeout=1.0)
                if self._error is not None:
                    if isinstance(self._error, ProducerDied):  # one line for the run (mpo.trainer.__main__)
                        raise ProducerDied(f"rollout producer failed: {self._error}") from None
                    raise RuntimeError(f"rollout producer failed: {self._error}") from self._error
                produced = self._batches.pop(step)
        self._trainer_from = time.perf_counter()
        self.samples_log = produced.rows
        self.taken_state = produced.state
        limit = step - self.lag
        # per sample, not per token: each sample's versions are one array (its oldest token decides)
        kept, dropped, oldest, tokens, age_sum = [], 0, step, 0, 0
        for sample in produced.samples:
            versions = np.asarray(sample.versions if sample.versions is not None else (), dtype=np.int64)
            if versions.size and int(versions.min()) < limit:
                dropped += 1
                continue
            kept.append(sample)
            if versions.size:
                oldest = min(oldest, int(versions.min()))
                tokens += versions.size
                age_sum += step * versions.size - int(versions.sum())
        if self.on_versions is not None:
            self.on_versions(step, [s.versions if s.versions is not None else [] for s in kept])
        metrics = dict(produced.metrics)
        metrics.update({"staleness_max": float(step - oldest),
                        "staleness_mean": age_sum / tokens if tokens else 0.0,
                        "staleness_dropped_samples": float(dropped),
                        "schedule/wait_s": self._trainer_from - waited})
        if dropped:
            log.warning("step %d: dropped %d samples staler than %d versions", step, dropped, self.lag)
        return kept, metrics

    def before_sync(self) -> None:
        """one_step_off: weights change only between batches, so wait for the batch in flight."""
        if self.mode == "one_step_off":
            self._generating.acquire()
        if self.memory is not None:
            self.memory("resume", ["weights"])  # the update needs the weights resident, not yet the KV cache

    def after_sync(self, version: int) -> None:
        if self.mode == "one_step_off":
            self._generating.release()
        if self.memory is not None:
            self.memory("resume", ["kv_cache"])
        with self._cv:
            self.version = version
            self._cv.notify_all()

    def step_metrics(self) -> dict[str, float]:
        """The step's wall time (end of the previous step to now), engine_busy_frac over it, and overlap_frac over the
        trainer's busy time (train + sync)."""
        now = time.perf_counter()
        with self._cv:
            busy = list(self._busy)
            if self._generating.locked():  # a batch in flight counts as busy up to now
                busy.append((self._batch_began, now))
            self._busy = [(a, b) for a, b in self._busy if b > self._trainer_from]
        wall, trainer = now - self._step_from, now - self._trainer_from
        metrics = {"schedule/step_s": wall,
                   "engine_busy_frac": _overlap(busy, self._step_from, now) / max(wall, 1e-9),
                   "overlap_frac": _overlap(busy, self._trainer_from, now) / max(trainer, 1e-9)}
        self._step_from = now
        return metrics

    def stop(self, abort: Callable[[], None] | None = None) -> None:
        """End the producer; `abort` (engines' abort_all) ends a batch in flight so the thread returns promptly."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._thread is not None and self._thread.is_alive():
            if abort is not None:
                try:
                    abort()
                except Exception as exc:  # noqa: BLE001 - engines may be gone already
                    log.warning("aborting rollouts in flight failed: %s", exc)
            self._thread.join(timeout=30)
