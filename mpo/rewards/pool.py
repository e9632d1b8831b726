"""Score completions in worker processes, with a per-completion timeout that survives hung or crashing rewards.

Each worker is ``python -m mpo.rewards._worker`` (a fresh interpreter: it does not re-import the trainer's main
module, as multiprocessing's spawn would, nor inherit CUDA or NCCL state, as fork would) talking over pipes. A
reward that raises, returns a non-finite value or crashes the worker gives 0.0 and counts an error; one still running
after `timeout_s` has its worker killed and replaced. Nothing a reward does ends the run; only a worker that cannot
start at all (the reward cannot be imported there) raises.
"""

from __future__ import annotations

import collections
import os
import selectors
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field

from ._worker import read_frame, write_frame
from .registry import get_reward

STARTUP_TIMEOUT_S = 120.0  # importing a reward (sympy, reasoning-gym's task modules) can take a while on a busy node
MAX_START_FAILURES = 3  # consecutive workers that die before "ready" before the pool gives up


@dataclass(eq=False)  # identity: the pool finds a worker by object, not by field values
class _Worker:
    proc: subprocess.Popen
    started: float
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0

    @property
    def stdin(self) -> int:
        return self.proc.stdin.fileno()

    @property
    def stdout(self) -> int:
        return self.proc.stdout.fileno()


def _kill(worker: _Worker) -> None:
    proc = worker.proc
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it to the OS, do not block the run
        pass
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.proc.stdin.close()  # end of input: an idle worker exits by itself
        except OSError:
            pass
    end = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _kill(w)
    workers.clear()


@dataclass
class _Batch:
    completions: list
    answers: list
    metadatas: list
    rewards: list[float] = field(default_factory=list)
    errors: int = 0


class RewardPool:
    """`workers` processes computing reward `fn_name` (a registered name or ``module:function``).

    `score(completions, answers, metadatas)` returns (rewards in input order, number of errors). `last_errors` holds
    a few messages of the last batch's errors, for the log. Not thread-safe: score from one thread.

    `timeout_s` should exceed the reward's own limits: math-verify gives parse and verify 5 s each (and returns 0
    itself), so about 15 s for `math`. Workers are killed if this process dies (PR_SET_PDEATHSIG; it fires when the
    creating *thread* exits, so create the pool on a long-lived thread).
    """

    def __init__(self, fn_name: str, *, timeout_s: float, workers: int) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s={timeout_s} must be > 0")
        if workers < 1:
            raise ValueError(f"reward workers={workers} must be >= 1")
        get_reward(fn_name)  # a bad name or plug-in fails here, with one line, not in the workers
        self.fn_name = fn_name
        self.timeout_s = float(timeout_s)
        self.n_workers = workers
        self.last_errors: list[str] = []
        self._env = self._worker_env()
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self._start_failures = 0
        for _ in range(workers):
            self._workers.append(self._start())

    @staticmethod
    def _worker_env() -> dict[str, str]:
        # The worker must import what this process can (plug-ins named module:function): give it our sys.path.
        env = dict(os.environ)
        paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        return env

    def _start(self) -> _Worker:
        proc = subprocess.Popen([sys.executable, "-m", "mpo.rewards._worker", self.fn_name, str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=self._env,
                                start_new_session=True)
        return _Worker(proc, time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        _kill(worker)
        self._workers[self._workers.index(worker)] = self._start()

    def _fail(self, batch: _Batch, worker: _Worker, message: str) -> None:
        assert worker.task is not None
        batch.rewards[worker.task] = 0.0
        batch.errors += 1
        if len(self.last_errors) < 8:
            self.last_errors.append(f"item {worker.task}: {message}")
        worker.task = None

    @staticmethod
    def _exit_code(worker: _Worker) -> int | None:
        try:
            return worker.proc.wait(timeout=5)  # its output closed: it is exiting, reap it for the code
        except subprocess.TimeoutExpired:
            return None

    def _on_message(self, batch: _Batch, worker: _Worker, message) -> None:
        if message is None:  # the worker died
            if worker.task is not None:
                self._fail(batch, worker, f"reward worker died (exit code {self._exit_code(worker)})")
            elif not worker.ready:
                self._start_failures += 1
                if self._start_failures >= MAX_START_FAILURES:
                    raise RuntimeError(f"reward {self.fn_name!r}: {self._start_failures} workers in a row died "
                                       f"while starting (last exit code {self._exit_code(worker)}); see stderr")
            self._replace(worker)
        elif message[0] == "ready":
            worker.ready = True
            self._start_failures = 0
        elif message[0] == "fatal":
            raise RuntimeError(f"reward {self.fn_name!r}: worker cannot load it: {message[1]}")
        else:
            task_id, ok, value = message
            if task_id != worker.task:  # cannot happen with one task per worker; guards against a protocol bug
                raise RuntimeError(f"reward worker answered item {task_id}, expected {worker.task}")
            if ok:
                batch.rewards[task_id] = value
                worker.task = None
            else:
                self._fail(batch, worker, value)

    def score(self, completions: list[str], answers: list, metadatas: list[dict]) -> tuple[list[float], int]:
        if not (len(completions) == len(answers) == len(metadatas)):
            raise ValueError(f"score: {len(completions)} completions, {len(answers)} answers, "
                             f"{len(metadatas)} metadatas: the lists must have one entry each")
        if not self._workers:
            raise RuntimeError("RewardPool is closed")
        batch = _Batch(completions, answers, metadatas, rewards=[0.0] * len(completions))
        self.last_errors = []
        pending = collections.deque(range(len(completions)))
        while pending or any(w.task is not None for w in self._workers):
            self._dispatch(batch, pending)
            self._wait(batch)
            self._expire(batch)
        return batch.rewards, batch.errors

    def _dispatch(self, batch: _Batch, pending: collections.deque) -> None:
        for worker in list(self._workers):
            if not pending:
                return
            if not worker.ready or worker.task is not None:
                continue
            i = pending.popleft()
            try:
                write_frame(worker.stdin, (i, batch.completions[i], batch.answers[i], batch.metadatas[i]))
            except OSError:  # died while idle: the item never ran, so it goes back to the queue
                pending.appendleft(i)
                self._replace(worker)
                continue
            worker.task = i
            worker.deadline = time.monotonic() + self.timeout_s

    def _wait(self, batch: _Batch) -> None:
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.task is not None]
        deadlines += [w.started + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        with selectors.DefaultSelector() as selector:
            for w in self._workers:
                selector.register(w.stdout, selectors.EVENT_READ, w)
            events = selector.select(timeout)
        for key, _ in events:
            worker = key.data
            if worker in self._workers:
                self._on_message(batch, worker, read_frame(worker.stdout))

    def _expire(self, batch: _Batch) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task is not None and now >= worker.deadline:
                self._fail(batch, worker, f"timed out after {self.timeout_s:g} s; worker killed and replaced")
                self._replace(worker)
            elif not worker.ready and now >= worker.started + STARTUP_TIMEOUT_S:
                raise RuntimeError(f"reward {self.fn_name!r}: a worker did not start within {STARTUP_TIMEOUT_S:g} s")

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
