"""The off-policy rollout producer as a child process of rank 0 (schedule.mode one_step_off / async).

Why a process: the schedule's producer (mpo.trainer.schedule) runs beside rank 0's training loop, and a thread there
shares its GIL: HTTP calls to the engines, decoding their arrays and routes, scoring bookkeeping and advantages all
took turns with the training step. Here the producer thread only waits on a pipe: ProducerProcess.collect asks a
spawned child that owns a Collector of its own (the engines' clients in a RolloutPool, the task with its prompt
stream and reward workers, prompt retirement, the advantage estimator) and answers with the step's samples and
metrics (plain pickle: lists and numpy arrays, no shared-memory tensors), its samples.jsonl rows and phase times.

The engines stay rank 0's (EngineSet): a restart the child's pool asks for, and whether an engine holds the current
weights, are asked of the parent. Checkpoints take the child's state (state_dict: advantages, retirement, the task's
data position); it starts from the parent's after resume and the warm start (load_state_dict). If the child dies,
the call in flight and every later one raise ProducerDied, one line naming it; close() ends it, and it dies with
rank 0 (PR_SET_PDEATHSIG, mpo.lifecycle). Sync mode does not use it: the Collector runs in rank 0's own thread.

A child that is alive but silent (stopped with SIGSTOP, or hung holding its GIL) would leave rank 0 waiting forever:
the child says it is alive every second from a thread of its own (a "beat", also during a long collect), and while
rank 0 waits for an answer it warns every 30 s of silence (a quarter of rollout.request_timeout_s, if less) and,
after all of rollout.request_timeout_s, kills the child: the call raises ProducerDied saying so (a producer that long
silent is hung, as an engine that long slow is). An engine failure the child's collect ends with (EngineError,
RolloutFailed) travels with its error, so rank 0 stops the run with its one line (mpo.rollout.pool.rollout_failure).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


class ProducerDied(RuntimeError):
    """The rollout producer's process is gone (a one-line failure of the run: mpo.trainer.__main__)."""


STARTUP_GRACE_S = 120.0  # silence allowed before the child's first beat (a spawned interpreter unpickling its args)


def _quiet_limits(config) -> tuple[float, float, float]:
    """(beat, warn, limit) seconds for a producer of `config`: the child beats every `beat` s; rank 0, waiting for an
    answer, warns every `warn` s of silence and gives up after `limit` s (rollout.request_timeout_s)."""
    limit = float(config.rollout.request_timeout_s)
    return min(1.0, limit / 20), min(30.0, limit / 4), limit


def _beat(conn, lock: threading.Lock, every_s: float) -> None:
    """The child's thread that says it is alive: stops when the pipe does (rank 0 is gone or the child ends)."""
    message = pickle.dumps(("beat", None), protocol=pickle.HIGHEST_PROTOCOL)
    while True:
        try:
            with lock:
                conn.send_bytes(message)
        except (OSError, ValueError):
            return
        time.sleep(every_s)


class _Link:
    """Calls both ways over one duplex pipe: call(method, *args) waits for the other side's answer; the other side's
    calls run handlers[method] each on a thread of its own (those named in `inline`, quick ones, on the reader's).
    `on_close()` -> the exception for callers once the pipe is closed."""

    def __init__(self, conn, handlers: dict[str, Callable], on_close: Callable[[], BaseException],
                 inline: tuple[str, ...] = (), send_lock: threading.Lock | None = None) -> None:
        self.conn, self.handlers, self._on_close, self._inline = conn, handlers, on_close, inline
        self._send_lock, self._lock = send_lock or threading.Lock(), threading.Lock()
        self._pending: dict[int, list] = {}
        self._ids = itertools.count()
        self.closed: BaseException | None = None
        self.heard, self.heard_any = time.monotonic(), False  # when the other side last sent anything (a beat too)
        threading.Thread(target=self._read, name="mpo-producer-link", daemon=True).start()

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def notify(self, method: str, *args) -> None:
        """A call with no answer."""
        self._send(("call", None, method, args))

    def call(self, method: str, *args) -> Any:
        box: list = [threading.Event(), False, None]  # answered, ok, value (or the exception)
        with self._lock:
            if self.closed is not None:
                raise self.closed
            key = next(self._ids)
            self._pending[key] = box
        with contextlib.suppress(OSError):  # the pipe is closing: the reader answers every pending call
            self._send(("call", key, method, args))
        box[0].wait()
        if box[1]:
            return box[2]
        raise box[2]

    def waiting(self) -> bool:
        """Is a call of this side waiting for its answer?"""
        return bool(self._pending)

    def _read(self) -> None:
        try:
            while True:
                kind, key, *rest = pickle.loads(self.conn.recv_bytes())
                self.heard, self.heard_any = time.monotonic(), True
                if kind == "beat":
                    continue
                if kind == "reply":
                    with self._lock:
                        box = self._pending.pop(key)
                    ok, value, *cause = rest
                    if not ok:
                        value = RuntimeError(value)
                        value.__cause__ = cause[0] if cause else None  # the engine failure behind it, if any
                    box[1], box[2] = ok, value
                    box[0].set()
                elif rest[0] in self._inline:
                    self._serve(key, *rest)
                else:
                    threading.Thread(target=self._serve, args=(key, *rest), daemon=True).start()
        except (EOFError, OSError):
            error = self._on_close()
            with self._lock:
                self.closed, pending, self._pending = error, self._pending, {}
            for box in pending.values():
                box[1], box[2] = False, error
                box[0].set()

    def _serve(self, key: int | None, method: str, args: tuple) -> None:
        try:
            reply = (True, self.handlers[method](*args))
        except BaseException as exc:  # noqa: BLE001 - the caller raises it, one line
            from mpo.rollout.pool import rollout_failure  # (not at import: rank 0 imports this module early)

            # an engine failure goes along (it pickles): the caller's run stops with its one line
            reply = (False, f"{type(exc).__name__}: {exc}", rollout_failure(exc))
        if key is None:
            if not reply[0]:
                log.error("%s failed: %s", method, reply[1])
            return
        try:
            self._send(("reply", key, *reply))
        except OSError:
            pass  # the other side is gone
        except Exception as exc:  # noqa: BLE001 - an answer that does not pickle
            self._send(("reply", key, False, f"{type(exc).__name__}: {exc}"))


class ProducerProcess:
    """Rank 0's handle on the producer child: collect(step, version) for RolloutSchedule, state_dict /
    load_state_dict for checkpoints, set_algorithm, samples_log (the last collect's rows), close().

    `engines`: EngineSet.handles (client, restart or None, current or None); `clock`: rank 0's PhaseClock, which
    gets the child's phase times of each collect."""

    def __init__(self, config, engines: list, *, context_length: int, clock=None) -> None:
        ctx = multiprocessing.get_context("spawn")  # not fork: rank 0 has threads, torch and gloo state
        parent_end, child_end = ctx.Pipe(duplex=True)
        self.engines, self.clock, self.samples_log = list(engines), clock, []
        kinds = [(len(h) > 1 and h[1] is not None, len(h) > 2 and h[2] is not None) for h in self.engines]
        self.process = ctx.Process(target=_child, name="mpo-rollout-producer",
                                   args=(child_end, config, [h[0] for h in self.engines], kinds, context_length,
                                         os.getpid()))
        self.process.start()
        child_end.close()  # ours closed: the child's exit is an EOF here
        self.pid, self._closing = self.process.pid, False
        self._reaping = threading.Lock()  # one thread at a time waits for the child (waitpid reaps it once)
        self._silent_s: float | None = None  # set when the watchdog killed a silent child
        self._limits = _quiet_limits(config)
        self._link = _Link(parent_end, {"restart": lambda i: self.engines[i][1](),
                                        "current": lambda i: self.engines[i][2]()}, on_close=self._gone,
                           inline=("current",))  # asked before each call the child's pool sends: kept quick
        threading.Thread(target=self._watch, name="mpo-producer-watchdog", daemon=True).start()
        log.info("rollout producer: process %d (rollouts off rank 0's GIL)", self.pid)

    def _watch(self) -> None:
        """While a call waits for the child: a warning every `warn` s of its silence, and after `limit` s it is
        killed, which fails the calls with ProducerDied (_gone says why)."""
        beat, warn, limit = self._limits
        warned = 0  # warnings of this silence so far
        while not self._closing and self._link.closed is None:
            time.sleep(beat)
            silent = time.monotonic() - self._link.heard
            if not self._link.waiting() or silent < warn:
                warned = 0
                continue
            if silent >= (limit if self._link.heard_any else max(limit, STARTUP_GRACE_S)):
                self._silent_s = silent
                self.process.kill()  # SIGKILL ends a stopped process too; its pipe's EOF fails the calls
                return
            if silent >= warn * (warned + 1):
                warned += 1
                log.warning("the rollout producer process (pid %d) has sent nothing for %.0f s (stopped or hung?); "
                            "the run stops after %.0f s of silence (rollout.request_timeout_s)", self.pid, silent,
                            limit)

    def _exitcode(self, wait_s: float = 0.0) -> int | None:
        """The child's exit code once it has exited (waiting up to `wait_s`), else None."""
        with self._reaping:
            self.process.join(timeout=wait_s)
            return self.process.exitcode

    def _gone(self) -> BaseException:
        code = self._exitcode(5.0)
        if self._closing:
            return ProducerDied(f"the rollout producer process (pid {self.pid}) was stopped")
        if self._silent_s is not None:
            return ProducerDied(f"the rollout producer process (pid {self.pid}) sent nothing for "
                                f"{self._silent_s:.0f} s (stopped or hung; rollout.request_timeout_s="
                                f"{self._limits[2]:g}) and was killed")
        how = ("is gone" if code is None else f"exited with code {code}" if code >= 0 else
               f"was killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else
               f"was killed by signal {-code}")
        return ProducerDied(f"the rollout producer process (pid {self.pid}) {how} (its last lines are in the log "
                            "above)")

    def collect(self, step: int, version: int | None = None) -> tuple[list, dict[str, float]]:
        samples, metrics, rows, phases = self._link.call("collect", step, version)
        self.samples_log = rows
        if self.clock is not None:
            for name, seconds in phases.items():
                self.clock.add(name, seconds)
        return samples, metrics

    def state_dict(self) -> dict[str, Any]:
        return self._link.call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._link.call("load_state_dict", state)

    def set_algorithm(self, config) -> None:
        self._link.call("set_algorithm", config)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the child (its reward workers with it); a collect in flight raises ProducerDied."""
        if self._closing:
            return
        self._closing = True
        if self._exitcode() is None:
            with contextlib.suppress(OSError):
                self._link.notify("stop")
            if self._exitcode(timeout_s) is None:
                log.warning("rollout producer %d did not stop in %.0f s; killing it", self.pid, timeout_s)
                self.process.kill()
                self._exitcode(5.0)


def _child(conn, config, clients: list, kinds: list[tuple[bool, bool]], context_length: int, parent: int) -> None:
    """The producer process: a Collector of its own, served over `conn` until the parent stops it or is gone."""
    from mpo.lifecycle import die_with_parent

    die_with_parent()  # before anything else: never outlive rank 0
    if os.getppid() != parent:  # rank 0 died while this process started (spawn imports its main module first)
        os._exit(1)
    send_lock = threading.Lock()  # the beats' and the link's messages, one at a time
    threading.Thread(target=_beat, args=(conn, send_lock, _quiet_limits(config)[0]), name="mpo-producer-beat",
                     daemon=True).start()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s producer%(process)d %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)  # small tensors only (advantages): leave the cores to the ranks
    from mpo.algorithms.step_advantages import StepAdvantages
    from mpo.data.retirement import PromptRetirement
    from mpo.trainer.collect import Collector
    from mpo.trainer.phases import PhaseClock
    from mpo.trainer.tasks import make_task

    stop = threading.Event()
    clock = PhaseClock(enabled=config.logging.phase_times)
    retire = config.data.retire_pass_rate
    task = make_task(config, rank=0)
    collector = Collector(config, task, retirement=PromptRetirement(retire) if retire is not None else None,
                          clock=clock, context_length=context_length,
                          advantages=StepAdvantages.for_algorithm(config.algorithm))
    link: _Link | None = None

    def engine(i: int, can_restart: bool, has_current: bool) -> tuple:
        return (clients[i], (lambda: link.call("restart", i)) if can_restart else None,
                (lambda: link.call("current", i)) if has_current else None)

    collector.connect([engine(i, *kind) for i, kind in enumerate(kinds)])

    def collect(step: int, version: int | None):
        samples, metrics = collector.collect(step, version)
        phases = {key[len("time/"):-len("_s")]: s for key, s in clock.take().items()}
        return samples, metrics, collector.samples_log, phases

    def set_algorithm(new) -> None:
        collector.set_algorithm(new, StepAdvantages.for_algorithm(new.algorithm))

    link = _Link(conn, {"collect": collect, "state_dict": collector.state_dict,
                        "load_state_dict": collector.load_state_dict, "set_algorithm": set_algorithm,
                        "stop": stop.set}, on_close=lambda: stop.set() or ConnectionError("rank 0 is gone"),
                 send_lock=send_lock)
    stop.wait()
    try:
        task.close()  # reward workers
    finally:
        logging.shutdown()
        os._exit(0)  # a collect in flight is abandoned (rank 0 aborts the engines' requests)
