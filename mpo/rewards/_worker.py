"""A RewardPool worker process: ``python -m mpo.rewards._worker NAME PARENT_PID [MAX_MEMORY_MB]``.

Protocol on private copies of stdin / stdout: frames of an 8-byte big-endian length and a pickle. The worker sends
("ready", pid) once the reward is imported and warmed up (or ("fatal", message) and exits), then for each
(task_id, completion, answer, metadata) it gets, (task_id, True, reward) or (task_id, False, "Error: message").
It exits at end of input.

Containment of what a reward does (a plug-in is arbitrary code):
  * fd 0 is /dev/null and fd 1 is stderr, and the protocol copies are close-on-exec: a reward that prints, or a
    program it runs, can neither read nor corrupt the protocol;
  * a plain ``os.fork()`` in a reward: the child loses the protocol (closed at fork) and exits when the reward
    returns or raises in it, so only the worker answers;
  * the process the pool starts is a guard, not the worker: it makes itself a child subreaper, forks the worker and
    waits. Whatever the reward starts stays below the guard, even a daemon that left its parent and called setsid()
    (orphans are re-parented to the nearest subreaper, not to init). When the worker dies (whatever killed it),
    when the pool stops the guard (SIGTERM) or when the pool's owner dies (PR_SET_PDEATHSIG, and a poll of the
    parent pid), the guard SIGKILLs every process below it, then exits as the worker did (its exit code or signal);
  * RLIMIT_DATA caps the memory of the worker and of what it starts (MAX_MEMORY_MB; 0: no cap): an allocation past
    it fails (MemoryError: a counted error) instead of taking the node's memory.

The parent reads the worker's frames with a cap on their length and the call's own deadline (mpo.rewards.pool), so a
reward that writes to the protocol itself (it is in this process and can find the fd) costs its call, never the run.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import resource
import signal
import struct
import sys

_HEADER = struct.Struct("!Q")
# Rewards become float32 tensors on the trainer (Sample rows): a value finite in float64 but not in float32 (1e308)
# would turn into inf there and NaN in the loss, so it counts as an error like nan does.
FLOAT32_MAX = 3.4028234663852886e38
GUARD_POLL_S = 0.2  # how often the guard checks that the pool's owner is alive (PR_SET_PDEATHSIG is the fast path)
MAX_FATAL_CHARS = 2000  # of a load failure's message: the pool caps a reward worker's frames (pool.MAX_REPLY_BYTES)


def read_exact(fd: int, n: int) -> bytes | None:
    """`n` bytes from `fd`, or None at end of input."""
    parts, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(fd: int):
    header = read_exact(fd, _HEADER.size)
    if header is None:
        return None
    body = read_exact(fd, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def write_frame(fd: int, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(body)) + body)
    while view:
        view = view[os.write(fd, view):]


def _set_death_signal(signum: int) -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG


def _die_with_parent(parent_pid: int) -> None:
    # A worker stuck in a reward function never reads the EOF of a dead parent: let the kernel kill it instead.
    _set_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def check_reward(value: float) -> float:
    """`value` if the trainer can use it: finite in float32 (the rewards' tensor dtype); else ValueError."""
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(f"reward is {value}, not a finite float32")
    return value


def _exit_as(status: int | None) -> None:
    """Exit as a child that ended with wait `status` did (None: stopped, not the worker's end)."""
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL / SIGSTOP have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else 128 + signal.SIGTERM)


def _guard_then_work(parent_pid: int) -> None:
    """Become the guard of the module doc: returns only in the worker (this process's child); the guard itself
    waits, kills every process below it once the worker is gone or it is told to stop, and exits."""
    from mpo.lifecycle import kill_descendants, set_child_subreaper

    # SIGTERM (the pool's stop, the parent-death signal) and SIGCHLD are taken with sigtimedwait, never by a handler
    # that could interrupt the clean-up: block them before the worker exists.
    wanted = {signal.SIGTERM, signal.SIGCHLD}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    _set_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:
        os._exit(0)
    set_child_subreaper()
    guard = os.getpid()
    worker = os.fork()
    if worker == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        _die_with_parent(guard)
        return
    status = None
    try:  # the guard holds no protocol fd: the pool must see the worker's end of input and output
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        while status is None:
            info = signal.sigtimedwait(wanted, GUARD_POLL_S)
            if (info is not None and info.si_signo == signal.SIGTERM) or os.getppid() != parent_pid:
                break
            while True:  # reap the worker, and any orphan re-parented here that has exited
                try:
                    pid, st = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:  # no child left at all: the worker is gone
                    status = 0 if status is None else status
                    break
                if pid == 0:
                    break
                if pid == worker:
                    status = st
        kill_descendants()
    finally:
        _exit_as(status)


def _limit_memory(max_memory_mb: int) -> None:
    if max_memory_mb > 0:
        limit = max_memory_mb << 20
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def serve(argv: list[str], load, handle) -> None:
    """The worker's life under the containment above: `load(name)` once (its failure is reported as ("fatal", ...)),
    then for each (task_id, *payload) frame, (task_id, True, handle(loaded, *payload)) or (task_id, False, "Error:
    message"). `handle` must return plain data (the parent unpickles it): the reward pool's floats, the environment
    pool's validated messages. Shared by mpo.rewards and mpo.envs, whose workers differ only in what they load."""
    name, parent_pid = argv[0], int(argv[1])
    max_memory_mb = int(argv[2]) if len(argv) > 2 else 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    _guard_then_work(parent_pid)
    inp, out = os.dup(0), os.dup(1)  # os.dup makes non-inheritable copies: programs a reward runs do not get them
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    me = os.getpid()

    def lose_protocol() -> None:  # in the child of an os.fork() done by the reward
        for fd in (inp, out):
            with contextlib.suppress(OSError):
                os.close(fd)

    os.register_at_fork(after_in_child=lose_protocol)
    _limit_memory(max_memory_mb)
    try:
        loaded = load(name)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        write_frame(out, ("fatal", f"{type(e).__name__}: {e}"[:MAX_FATAL_CHARS]))
        return
    write_frame(out, ("ready", os.getpid()))
    while True:
        message = read_frame(inp)
        if message is None:
            return
        task_id, payload = message[0], message[1:]
        try:
            reply = (task_id, True, handle(loaded, *payload))
        except BaseException as e:  # noqa: BLE001 - any failure of the plug-in is a counted error
            reply = (task_id, False, f"{type(e).__name__}: {str(e)[:500]}")
        if os.getpid() != me:  # the child of a fork in the plug-in came back here: only the worker answers
            os._exit(0)
        write_frame(out, reply)


def _load_reward(name: str):
    from mpo.rewards.registry import get_reward, warm_up

    fn = get_reward(name)
    warm_up(name)
    return fn


def _score(fn, completion, answer, metadata) -> float:
    return check_reward(float(fn(completion, answer, metadata)))


if __name__ == "__main__":
    serve(sys.argv[1:], _load_reward, _score)
