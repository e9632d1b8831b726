"""Score completions in worker processes, with a per-completion timeout that survives hung or crashing rewards.

Each worker is ``python -m mpo.rewards._worker`` (a fresh interpreter: it does not re-import the trainer's main
module, as multiprocessing's spawn would, nor inherit CUDA or NCCL state, as fork would) talking over pipes. A
reward that raises, returns a non-finite value or crashes the worker gives 0.0 and counts an error; one still running
after `timeout_s` has its worker killed and replaced. Nothing a reward does ends the run; only a worker that cannot
start at all (the reward cannot be imported there) raises.

A worker is killed with its whole process group (what the reward started goes with it; _worker.py's guard does the
same when the trainer dies), its memory is capped (`max_memory_mb`), and its stderr comes through a pipe the pool
drains: at most MAX_OUTPUT_BYTES a batch reach our stderr, the rest is dropped and counted, so a reward printing
hundreds of megabytes a call neither fills the disk nor stalls on a full pipe.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import selectors
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field

from ._worker import read_frame, write_frame
from .registry import get_reward

STARTUP_TIMEOUT_S = 120.0  # importing a reward (sympy, reasoning-gym's task modules) can take a while on a busy node
MAX_START_FAILURES = 3  # consecutive workers that die before "ready" before the pool gives up
MAX_OUTPUT_BYTES = 64 << 10  # of the workers' stderr passed on per batch; the rest is dropped (counted)
DEFAULT_MAX_MEMORY_MB = 4096  # a worker with math + reasoning-gym loaded has ~170 MB of data
_F_SETPIPE_SZ = 1031  # Linux fcntl: a 1 MiB stderr pipe drains a chatty reward in 16x fewer reads


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

    @property
    def stderr(self) -> int | None:
        return self.proc.stderr.fileno() if self.proc.stderr is not None and not self.proc.stderr.closed else None


def _kill(worker: _Worker) -> None:
    proc = worker.proc
    # The worker leads its process group (start_new_session): the group holds what its reward started. The group
    # outlives a reaped leader while members remain, and its id is not reused meanwhile.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it to the OS, do not block the run
        pass
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is None:
            continue
        try:
            f.close()
        except OSError:
            pass


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        if not w.ready:  # still importing the reward: nothing to finish, do not wait for the import
            _kill(w)
            continue
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
    items: list  # one tuple of call arguments per task (the worker gets (task_id, *item))
    results: list = field(default_factory=list)  # a failed task's entry is the pool's failure value
    errors: int = 0
    failed: set[int] = field(default_factory=set)


class RewardPool:
    """`workers` processes computing reward `fn_name` (a registered name or ``module:function``).

    `score(completions, answers, metadatas)` returns (rewards in input order, number of errors). `last_errors` holds
    a few messages of the last batch's errors, for the log. Not thread-safe: score from one thread.

    `timeout_s` should exceed the reward's own limits: math-verify gives parse and verify 5 s each (and returns 0
    itself), so about 15 s for `math`. Workers are killed if this process dies (PR_SET_PDEATHSIG; it fires when the
    creating *thread* exits, so create the pool on a long-lived thread).
    """

    worker_module = "mpo.rewards._worker"  # what each worker runs (mpo.envs.pool.EnvPool runs its own)
    kind = "reward"  # in messages

    def __init__(self, fn_name: str, *, timeout_s: float, workers: int,
                 max_memory_mb: int | None = DEFAULT_MAX_MEMORY_MB) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s={timeout_s} must be > 0")
        if workers < 1:
            raise ValueError(f"reward workers={workers} must be >= 1")
        if max_memory_mb is not None and max_memory_mb < 64:
            raise ValueError(f"reward max_memory_mb={max_memory_mb} must be >= 64 (or None: no cap)")
        self._check_name(fn_name)  # a bad name or plug-in fails here, with one line, not in the workers
        self.fn_name = fn_name
        self.timeout_s = float(timeout_s)
        self.max_memory_mb = max_memory_mb or 0
        self.last_errors: list[str] = []
        self.dropped_output_bytes = 0  # workers' stderr dropped over MAX_OUTPUT_BYTES a batch, over the pool's life
        self._output_left = MAX_OUTPUT_BYTES
        self._env = self._worker_env()
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self._start_failures = 0
        for _ in range(workers):
            self._workers.append(self._start())

    @staticmethod
    def _check_name(fn_name: str) -> None:
        get_reward(fn_name)

    @staticmethod
    def _worker_env() -> dict[str, str]:
        # The worker must import what this process can (plug-ins named module:function): give it our sys.path.
        env = dict(os.environ)
        paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        return env

    def _start(self) -> _Worker:
        proc = subprocess.Popen([sys.executable, "-m", self.worker_module, self.fn_name, str(os.getpid()),
                                 str(self.max_memory_mb)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                                env=self._env, start_new_session=True)
        with contextlib.suppress(OSError):
            fcntl.fcntl(proc.stderr.fileno(), _F_SETPIPE_SZ, 1 << 20)
        return _Worker(proc, time.monotonic())

    def _pass_output(self, worker: _Worker) -> None:
        """Move what the worker wrote to stderr to ours, within this batch's MAX_OUTPUT_BYTES."""
        chunk = os.read(worker.stderr, 1 << 20)
        if not chunk:  # stderr closed (the worker is exiting): stop watching it
            worker.proc.stderr.close()
            return
        keep = chunk[:max(0, self._output_left)]
        dropped = len(chunk) - len(keep)
        if dropped and self._output_left > 0:
            keep += (f"\nmpo: {self.kind} {self.fn_name!r}: workers wrote over {MAX_OUTPUT_BYTES >> 10} KiB to stderr "
                     "in this batch; the rest of it is dropped\n").encode()
        self._output_left -= len(chunk)
        self.dropped_output_bytes += dropped
        with contextlib.suppress(OSError):  # our stderr closed: the output is only diagnostics
            view = memoryview(keep)
            while view:
                view = view[os.write(2, view):]

    def _replace(self, worker: _Worker) -> None:
        _kill(worker)
        self._workers[self._workers.index(worker)] = self._start()

    def _fail(self, batch: _Batch, worker: _Worker, message: str) -> None:
        assert worker.task is not None
        batch.results[worker.task] = self._failed_value
        batch.failed.add(worker.task)
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
                self._fail(batch, worker, f"{self.kind} worker died (exit code {self._exit_code(worker)})")
            elif not worker.ready:
                self._start_failures += 1
                if self._start_failures >= MAX_START_FAILURES:
                    raise RuntimeError(f"{self.kind} {self.fn_name!r}: {self._start_failures} workers in a row died "
                                       f"while starting (last exit code {self._exit_code(worker)}); see stderr")
            self._replace(worker)
        elif message[0] == "ready":
            worker.ready = True
            self._start_failures = 0
        elif message[0] == "fatal":
            raise RuntimeError(f"{self.kind} {self.fn_name!r}: worker cannot load it: {message[1]}")
        else:
            task_id, ok, value = message
            if task_id != worker.task:  # cannot happen with one task per worker; guards against a protocol bug
                raise RuntimeError(f"{self.kind} worker answered item {task_id}, expected {worker.task}")
            if ok:
                batch.results[task_id] = value
                worker.task = None
            else:
                self._fail(batch, worker, value)

    def score(self, completions: list[str], answers: list, metadatas: list[dict]) -> tuple[list[float], int]:
        if not (len(completions) == len(answers) == len(metadatas)):
            raise ValueError(f"score: {len(completions)} completions, {len(answers)} answers, "
                             f"{len(metadatas)} metadatas: the lists must have one entry each")
        if not self._workers:
            raise RuntimeError("RewardPool is closed")
        batch = self.run(list(zip(completions, answers, metadatas)), 0.0)
        return batch.results, batch.errors

    _failed_value = 0.0

    def run(self, items: list[tuple], failed_value=None) -> _Batch:
        """Call the workers' plug-in once per item (a tuple of arguments); results in input order, `failed_value`
        where the call raised, timed out or crashed its worker (their indices in `failed`)."""
        if not self._workers:
            raise RuntimeError(f"{type(self).__name__} is closed")
        self._failed_value = failed_value
        batch = _Batch(list(items), results=[failed_value] * len(items))
        self.last_errors = []
        self._output_left = MAX_OUTPUT_BYTES
        pending = collections.deque(range(len(items)))
        while pending or any(w.task is not None for w in self._workers):
            self._dispatch(batch, pending)
            self._wait(batch)
            self._expire(batch)
        return batch

    def _dispatch(self, batch: _Batch, pending: collections.deque) -> None:
        for worker in list(self._workers):
            if not pending:
                return
            if not worker.ready or worker.task is not None:
                continue
            i = pending.popleft()
            try:
                write_frame(worker.stdin, (i, *batch.items[i]))
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
                selector.register(w.stdout, selectors.EVENT_READ, (w, False))
                if w.stderr is not None:
                    selector.register(w.stderr, selectors.EVENT_READ, (w, True))
            events = selector.select(timeout)
        for key, _ in sorted(events, key=lambda e: not e[0].data[1]):  # output first: it came before the answer
            worker, is_output = key.data
            if worker not in self._workers:
                continue
            if is_output:
                if worker.stderr is not None:
                    self._pass_output(worker)
            else:
                self._on_message(batch, worker, read_frame(worker.stdout))

    def _expire(self, batch: _Batch) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task is not None and now >= worker.deadline:
                self._fail(batch, worker, f"timed out after {self.timeout_s:g} s; worker killed and replaced")
                self._replace(worker)
            elif not worker.ready and now >= worker.started + STARTUP_TIMEOUT_S:
                raise RuntimeError(f"{self.kind} {self.fn_name!r}: a worker did not start within "
                                   f"{STARTUP_TIMEOUT_S:g} s")

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
