"""Score completions in worker processes, with a per-completion timeout that survives hung or crashing rewards.

Each worker is ``python -m mpo.rewards._worker`` (a fresh interpreter: it does not re-import the trainer's main
module, as multiprocessing's spawn would, nor inherit CUDA or NCCL state, as fork would) talking over pipes. A
reward that raises, returns a non-finite value or crashes the worker gives 0.0 and counts an error; one still running
after `timeout_s` has its worker killed and replaced. Nothing a reward does ends the run; only a worker that cannot
start at all (the reward cannot be imported there) raises.

The process the pool starts is the worker's guard (mpo.rewards._worker): stopping it (SIGTERM) kills the worker and
every process below it, a setsid() daemon included, as it does by itself when the worker dies or the trainer does.
Its memory is capped (`max_memory_mb`), and its stderr comes through a pipe the pool drains: at most
MAX_OUTPUT_BYTES a batch reach our stderr, the rest is dropped and counted, so a reward printing hundreds of megabytes
a call neither fills the disk nor stalls on a full pipe.

The worker's answers are read as they arrive, never with a blocking read: a frame's declared length is checked
against a cap (`max_frame_bytes`) before anything is read or allocated, a frame still incomplete at its call's
deadline is that call's timeout, and a frame that does not unpickle to what the protocol allows (plain data only) is
a broken worker. Each of these fails the call alone (counted) and replaces the worker; none raises. The same holds
for writing a call to a worker that does not read it (bounded by the call's deadline).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import io
import os
import pickle
import select
import selectors
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field

from ._worker import _HEADER, check_reward
from .registry import get_reward

STARTUP_TIMEOUT_S = 120.0  # importing a reward (sympy, reasoning-gym's task modules) can take a while on a busy node
MAX_START_FAILURES = 3  # consecutive workers that die before "ready" before the pool gives up
MAX_OUTPUT_BYTES = 64 << 10  # of the workers' stderr passed on per batch; the rest is dropped (counted)
DEFAULT_MAX_MEMORY_MB = 4096  # a worker with math + reasoning-gym loaded has ~170 MB of data
_F_SETPIPE_SZ = 1031  # Linux fcntl: a 1 MiB stderr pipe drains a chatty reward in 16x fewer reads
MAX_REPLY_BYTES = 1 << 20  # of one reward worker frame: a float or a 500-character error (a load failure: 2000)
READ_CHUNK = 1 << 20  # bytes read from a worker's output per ready event
GUARD_STOP_S = 5.0  # for the guard to kill what is below it and exit after SIGTERM, before the group is SIGKILLed


@dataclass(eq=False)  # identity: the pool finds a worker by object, not by field values
class _Worker:
    proc: subprocess.Popen
    started: float
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0
    inbox: bytearray = field(default_factory=bytearray)  # the frame being read: its header, then its body
    frame_len: int | None = None  # the declared length of the frame being read, once its header is in

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
    # The guard (proc) kills the worker and everything below it, then exits. Should it not exit, SIGKILL its process
    # group (start_new_session): it, the worker and what stayed in the group. The group outlives a reaped leader
    # while members remain, and its id is not reused meanwhile.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        proc.send_signal(signal.SIGTERM)  # no signal once proc is reaped: its pid may be another process's
    try:
        proc.wait(timeout=GUARD_STOP_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state): left to the OS, not waited for
            proc.wait(timeout=10)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        if not w.ready:  # still importing the reward: nothing to finish, do not wait for the import
            _kill(w)
            continue
        with contextlib.suppress(OSError):
            w.proc.stdin.close()  # end of input: an idle worker exits by itself
    end = time.monotonic() + 2.0
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=max(0.0, end - time.monotonic()))
        _kill(w)
    workers.clear()


@dataclass
class _Batch:
    items: list  # one tuple of call arguments per task (the worker gets (task_id, *item))
    results: list = field(default_factory=list)  # the failure value until the task succeeds (then it cannot fail)
    errors: int = 0
    failed: set[int] = field(default_factory=set)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (str, bytes, numbers, bool, None, tuple, list, dict): a frame naming any class or
    function is refused, so nothing a plug-in writes on the protocol runs code here."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"frame refers to {module}.{name}; only plain data is allowed")


class _Broken(Exception):
    """A worker broke the protocol; the message says how (the call fails, the worker is replaced)."""


class RewardPool:
    """`workers` processes computing reward `fn_name` (a registered name or ``module:function``).

    `score(completions, answers, metadatas)` returns (rewards in input order, number of errors). `last_errors` holds
    the messages of the last batch's first 8 errors in input order, for the log. Not thread-safe: score from one thread.

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
        self._errors: list[tuple[int, str]] = []  # (item, message) of the last batch's lowest-indexed 8 errors
        self.dropped_output_bytes = 0  # workers' stderr dropped over MAX_OUTPUT_BYTES a batch, over the pool's life
        self._output_left = MAX_OUTPUT_BYTES
        self._env = self._worker_env()
        self.max_frame_bytes = self._max_frame_bytes()
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self._start_failures = 0
        self._workers.extend(self._start() for _ in range(workers))

    @staticmethod
    def _check_name(fn_name: str) -> None:
        get_reward(fn_name)

    def _max_frame_bytes(self) -> int:
        """The most bytes one frame from a worker may declare; a larger one is a broken worker."""
        return MAX_REPLY_BYTES

    def _worker_args(self) -> list[str]:
        """The worker's command-line arguments after the module name."""
        return [self.fn_name, str(os.getpid()), str(self.max_memory_mb)]

    def _check_value(self, value):
        """A successful call's result as the worker sent it, checked again here (a plug-in may have written the
        frame itself): the value to keep, or an exception (the call fails and the worker is replaced)."""
        if type(value) is not float:
            raise ValueError(f"reward is a {type(value).__name__}, not a float")
        return check_reward(value)

    @staticmethod
    def _worker_env() -> dict[str, str]:
        # The worker must import what this process can (plug-ins named module:function): give it our sys.path.
        env = dict(os.environ)
        paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        return env

    def _start(self) -> _Worker:
        proc = subprocess.Popen([sys.executable, "-m", self.worker_module, *self._worker_args()],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                                env=self._env, start_new_session=True)
        with contextlib.suppress(OSError):
            fcntl.fcntl(proc.stderr.fileno(), _F_SETPIPE_SZ, 1 << 20)
        os.set_blocking(proc.stdin.fileno(), False)  # _send waits with a deadline, never on a full pipe
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

    @property
    def last_errors(self) -> list[str]:
        """The last batch's first 8 errors in input order ("item i: message"), for the log."""
        return [f"item {i}: {message}" for i, message in sorted(self._errors)]

    def _fail(self, batch: _Batch, worker: _Worker, message: str) -> None:
        assert worker.task is not None
        batch.failed.add(worker.task)
        batch.errors += 1
        # the batch's lowest-indexed 8, not the first 8 to finish: the log's "first" error is the input's first,
        # whichever worker was faster
        self._errors.append((worker.task, message))
        if len(self._errors) > 8:
            self._errors.remove(max(self._errors))
        worker.task = None

    @staticmethod
    def _exit_code(worker: _Worker) -> int | None:
        try:
            return worker.proc.wait(timeout=5)  # its output closed: it is exiting, reap it for the code
        except subprocess.TimeoutExpired:
            return None

    def _broken(self, batch: _Batch, worker: _Worker, message: str) -> None:
        """`worker` broke the protocol: its call (if any) fails with `message`, and a fresh worker takes its place."""
        if worker.task is not None:
            self._fail(batch, worker, f"{self.kind} worker {message}; worker killed and replaced")
        elif not worker.ready:
            self._count_start_failure(worker)
        self._replace(worker)

    def _count_start_failure(self, worker: _Worker) -> None:
        self._start_failures += 1
        if self._start_failures >= MAX_START_FAILURES:
            raise RuntimeError(f"{self.kind} {self.fn_name!r}: {self._start_failures} workers in a row died "
                               f"while starting (last exit code {self._exit_code(worker)}); see stderr")

    def _read(self, batch: _Batch, worker: _Worker) -> None:
        """Read what `worker`'s output holds now (select said it is readable; one read never blocks then): at most
        the rest of the current frame, whose declared length is checked before its body is read."""
        if worker.ready and worker.task is None:  # an idle worker has nothing to say: output now is a broken
            self._replace(worker)  # protocol, end of output is its death; either way a fresh worker takes its place
            return
        inbox = worker.inbox
        want = _HEADER.size - len(inbox) if worker.frame_len is None else worker.frame_len - len(inbox)
        try:
            chunk = os.read(worker.stdout, min(want, READ_CHUNK))
        except OSError:
            chunk = b""
        if not chunk:
            self._on_message(batch, worker, None)
            return
        inbox += chunk
        if worker.frame_len is None:
            if len(inbox) < _HEADER.size:
                return
            (length,) = _HEADER.unpack(inbox)
            inbox.clear()
            if length > self.max_frame_bytes:
                self._broken(batch, worker, f"sent a frame of {length} bytes, over the cap of {self.max_frame_bytes}")
                return
            worker.frame_len = length
            if length:
                return
        if len(inbox) < worker.frame_len:
            return
        body = bytes(inbox)
        inbox.clear()
        worker.frame_len = None
        try:
            message = _PlainUnpickler(io.BytesIO(body)).load()
        except Exception as e:  # noqa: BLE001 - whatever the bytes were, they are not a frame
            self._broken(batch, worker, f"sent an unreadable frame ({type(e).__name__}: {str(e)[:200]})")
            return
        try:
            self._on_message(batch, worker, message)
        except _Broken as e:
            self._broken(batch, worker, str(e))

    def _on_message(self, batch: _Batch, worker: _Worker, message) -> None:
        if message is None:  # the worker died
            if worker.task is not None:
                self._fail(batch, worker, f"{self.kind} worker died (exit code {self._exit_code(worker)})")
            elif not worker.ready:
                self._count_start_failure(worker)
            self._replace(worker)
            return
        if not isinstance(message, tuple) or not message:
            raise _Broken(f"sent a {type(message).__name__}, not a protocol tuple")
        if not worker.ready:
            if message[0] == "ready" and len(message) == 2:
                worker.ready = True
                self._start_failures = 0
            elif message[0] == "fatal" and len(message) == 2 and isinstance(message[1], str):
                raise RuntimeError(f"{self.kind} {self.fn_name!r}: worker cannot load it: {message[1]}")
            else:
                raise _Broken("sent something else than ready or fatal while starting")
            return
        if len(message) != 3 or message[0] != worker.task or type(message[1]) is not bool:
            raise _Broken(f"answered with {str(message)[:80]!r}, not (item {worker.task}, ok, value)")
        task_id, ok, value = message
        if not ok:
            self._fail(batch, worker, value[:1000] if isinstance(value, str) else "error of unknown type")
            return
        try:
            batch.results[task_id] = self._check_value(value)
        except Exception as e:  # noqa: BLE001 - a result the worker should never have sent
            raise _Broken(f"sent a bad result ({type(e).__name__}: {str(e)[:200]})") from None
        worker.task = None

    def score(self, completions: list[str], answers: list, metadatas: list[dict]) -> tuple[list[float], int]:
        if not (len(completions) == len(answers) == len(metadatas)):
            raise ValueError(f"score: {len(completions)} completions, {len(answers)} answers, "
                             f"{len(metadatas)} metadatas: the lists must have one entry each")
        batch = self.run(list(zip(completions, answers, metadatas)), 0.0)
        return batch.results, batch.errors

    def run(self, items: list[tuple], failed_value=None) -> _Batch:
        """Call the workers' plug-in once per item (a tuple of arguments); results in input order, `failed_value`
        where the call raised, timed out or crashed its worker (their indices in `failed`)."""
        if not self._workers:
            raise RuntimeError(f"{type(self).__name__} is closed")
        batch = _Batch(list(items), results=[failed_value] * len(items))
        self._errors = []
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
            worker.task = i
            worker.deadline = time.monotonic() + self.timeout_s
            sent = self._send(worker, (i, *batch.items[i]))
            if sent is None:  # died while idle: the item never ran, so it goes back to the queue
                worker.task = None
                pending.appendleft(i)
                self._replace(worker)
            elif not sent:  # the worker does not read its input: the call's time is up (_expire fails it)
                worker.deadline = time.monotonic()

    def _send(self, worker: _Worker, message) -> bool | None:
        """Write one frame to `worker` before its call's deadline: True when written, False when the deadline came
        first, None when the worker is gone."""
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_HEADER.pack(len(body)) + body)
        while view:
            try:
                view = view[os.write(worker.stdin, view):]
                continue
            except BlockingIOError:
                pass
            except OSError:
                return None
            left = worker.deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([], [worker.stdin], [], left)
        return True

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
                self._read(batch, worker)

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
