"""Process lifecycle: no mpo process outlives the one that started it; one run per run directory; a full disk ends the
run with one line.

Chain of a local run: `mpo` CLI -> torchrun (`mpo.torchrun`) -> trainer ranks -> rank 0's engines. torchrun and the
engines run in their own sessions, so a `kill -9` of the launcher's process group reaches none of them: every child
calls `exit_with_parent()` first thing, which asks Linux for SIGKILL when its parent dies (PR_SET_PDEATHSIG) and also
polls its parent from a thread. Keep this module light (stdlib only): it runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Iterator

# Set by a parent for a child it starts: "<pid>:signal" or "<pid>:poll" (see child_env). Consumed by the child, so a
# grandchild started with an inherited environment never mistakes its grandparent for its parent.
PARENT_ENV = "MPO_PARENT"
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
WATCHDOG_PERIOD_S = 0.5


def child_env() -> dict[str, str]:
    """Environment entries for a child that must die with this process (read by `exit_with_parent` in the child).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: a child started from a
    short-lived thread (an engine restarted from asyncio.to_thread) must only poll, or it would be killed with that
    thread."""
    how = "signal" if threading.current_thread() is threading.main_thread() else "poll"
    return {PARENT_ENV: f"{os.getpid()}:{how}"}


def _prctl(option: int, value: int) -> bool:
    """prctl(option, value) on Linux; False where unsupported or refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_parent_death_signal() -> bool:
    """SIGKILL this process when its parent thread exits (Linux; it survives exec). False where unsupported."""
    return _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def set_child_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux): a process started below it whose parent
    exits is re-parented here instead of to init, even after it called setsid(), so it stays in this process's tree
    for `kill_descendants`. The caller must reap them (os.waitpid). False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _stat(pid: int) -> tuple[int, int, str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the command name, in parentheses, may hold anything
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0].decode()


def descendants(root: int) -> dict[int, int]:
    """The live (not zombie) processes below `root`: pid -> start time (which tells a reused pid apart)."""
    children: dict[int, list[tuple[int, int, str]]] = {}  # parent pid -> (pid, start time, state) of /proc's processes
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append((pid, *stat[1:]))
    found, todo = {}, [root]
    while todo:
        for pid, start, state in children.get(todo.pop(), ()):
            if pid not in found:
                todo.append(pid)
                if state != "Z":
                    found[pid] = start
    return found


def _kill_exactly(pid: int, start: int) -> None:
    """SIGKILL `pid` if it is still the process that started at `start`: through a pidfd, so a pid that was freed
    and reused since the scan is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): check, then signal by pid (a tiny window remains)
        stat = _stat(pid)
        if stat is not None and stat[1] == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return
    try:
        stat = _stat(pid)
        if stat is not None and stat[1] == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def _reap_children() -> None:
    with contextlib.suppress(ChildProcessError):  # no child left
        while os.waitpid(-1, os.WNOHANG)[0] != 0:  # 0: children remain, none exited
            pass


def kill_descendants(timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every process below this one (a child subreaper: see `set_child_subreaper`) and reap its children;
    returns the pids still alive after `timeout_s` (unkillable, D state). Rounds repeat until a scan finds none:
    what a dying process forked after a scan is re-parented here and found by the next one."""
    me, deadline = os.getpid(), time.monotonic() + timeout_s
    while True:
        left = descendants(me)
        if not left or time.monotonic() >= deadline:
            _reap_children()
            return sorted(left)
        for pid, start in left.items():
            _kill_exactly(pid, start)
        _reap_children()
        time.sleep(0.005)


def _die(reason: str) -> None:
    print(f"mpo: {reason}; stopping (pid {os.getpid()})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_with_parent(*, signal_by_default: bool = True) -> None:
    """Call first thing in a child process: from now on it dies within a second of its parent.

    The parent's pid comes from MPO_PARENT when the parent set it (then a parent that died before this call is
    caught too); otherwise the current parent is taken. `signal_by_default`: use the death signal when the parent did
    not say (torchrun forks its ranks from its main thread; an engine's starter may be any thread).
    """
    pid_text, _, how = os.environ.pop(PARENT_ENV, "").partition(":")
    use_signal = how == "signal" if how else signal_by_default
    if use_signal:
        set_parent_death_signal()
    parent = os.getppid()
    # The parent may have died between our fork and the prctl above: then the signal will never come. Without
    # MPO_PARENT that window stays open (a parent of pid 1 proves nothing: in a container the launcher may be pid 1).
    if pid_text.isdigit() and parent != int(pid_text):
        _die(f"parent process {pid_text} exited before this process started")

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                _die(f"parent process {parent} is gone")
            time.sleep(WATCHDOG_PERIOD_S)

    threading.Thread(target=watch, name="mpo-parent-watchdog", daemon=True).start()


def freeze_startup_heap() -> None:
    """Call once start-up is done, before a process's steady loop (a trainer rank's steps, an engine's serving):
    collect once, then move every object alive now to the permanent generation (gc.freeze). Python's full
    collections traverse every tracked object: in a rank or an engine that is megatron's and torch's module graph and
    all start-up made, so each full collection stalls whichever phase it lands in, at a different moment on every rank
    (docs/measurements.md). Frozen objects are never collected, so the garbage start-up left in reference cycles (a
    checkpoint load's temporaries) is collected first."""
    gc.collect()
    gc.freeze()


def die_with_parent() -> None:
    """exit_with_parent for a multiprocessing child's initializer (picklable by name): the child stops within a
    second of the process that started it, however that one ended."""
    exit_with_parent(signal_by_default=True)


def preexec_exit_with_this_process() -> Callable[[], None]:
    """A `subprocess.Popen(preexec_fn=...)` for children that are not mpo code (torchrun run directly, SGLang): the
    death signal is set between fork and exec, and survives the exec. Call it in the thread that starts the child and
    lives as long as this process (the signal fires when that thread exits); only in single-threaded parents:
    preexec_fn is unsafe with threads."""
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal()
        if os.getppid() != parent:  # died before the prctl: the signal will never come
            os._exit(1)

    return preexec


class RunDirInUse(Exception):
    """Another live run holds the run directory's lock."""


def lock_run_dir(out_dir: str | Path) -> IO[str]:
    """Take `<out_dir>/.lock` for this process until it exits or closes the returned file.

    flock is released by the kernel when the holder dies, however it dies, so a crashed run never blocks the next.
    The file is opened close-on-exec, so children do not keep the lock alive after the holder has gone."""
    path = Path(out_dir) / ".lock"
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")  # not "w": truncating would erase the holder's line before we know we may
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "pid ? on host ?"
        handle.close()
        raise RunDirInUse(f"run directory {out_dir} is in use by {holder}") from None
    with writing(path):
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        handle.flush()
    return handle


class NoSpaceLeft(OSError):
    """A write failed for lack of space; its message is the one line the run stops with."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        super().__init__(errno.ENOSPC, f"no space left on {path.parent} while writing {path.name}")
        self.path = path

    def __str__(self) -> str:
        return self.strerror


def _no_space_error(exc: BaseException | None) -> bool:
    """ENOSPC (or EDQUOT over a quota) in `exc` or what it was raised from: torch.save's zip writer, failing to
    finish a file after the OSError, raises a RuntimeError ("unexpected pos ...") from within its handler."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Around a write of `path`: a full disk becomes NoSpaceLeft naming the file.

    torch.save must be given an open file, not a path: with a path its C++ writer reports a full disk only as an
    opaque RuntimeError, with a file the OSError comes through (as the RuntimeError's context)."""
    try:
        yield
    except NoSpaceLeft:
        raise
    except Exception as exc:
        if _no_space_error(exc):
            raise NoSpaceLeft(path) from exc
        raise


def first_no_space(exc: NoSpaceLeft) -> NoSpaceLeft:
    """The earliest NoSpaceLeft behind `exc`: a full disk met first by a checkpoint is met again by the clean-up
    that runs while it propagates (closing the TensorBoard writer); the first write is the one to name."""
    first, seen, current = exc, 0, exc.__cause__ or exc.__context__
    while current is not None and seen < 16:
        if isinstance(current, NoSpaceLeft):
            first = current
        current, seen = current.__cause__ or current.__context__, seen + 1
    return first


def quiet_no_space_in_threads() -> None:
    """A background writer thread (TensorBoard's) that hits a full disk dies without printing its traceback: the
    main thread meets the same error at its next write and ends the run with one line."""
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not _no_space_error(args.exc_value):
            default(args)

    threading.excepthook = hook


# Exit code of a rank that stopped on a failure it described in one line (the line is in torchrun's error file).
REPORTED_FAILURE_EXIT = 3
_ONE_LINE_PREFIX = "mpo: "


def stop_rank_with_one_line(message: str) -> None:
    """End a trainer rank on a failure that `message` fully describes, with no traceback.

    Under torchrun the line goes into the rank's error file (TORCHELASTIC_ERROR_FILE): `mpo.torchrun` prints the
    first such line once for the whole job instead of torchrun's report and one traceback per rank."""
    try:
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": _ONE_LINE_PREFIX + message, "timestamp": str(int(time.time()))}, f)
    except (KeyError, OSError):  # not under torchrun, or its directory is on the full disk too
        print(_ONE_LINE_PREFIX + message, file=sys.stderr, flush=True)
    os._exit(REPORTED_FAILURE_EXIT)  # no atexit, no destroy_process_group waiting on peers that are gone


def one_line_failure(message: object) -> bool:
    """Is this torchrun failure message one written by stop_rank_with_one_line?"""
    return isinstance(message, str) and message.startswith(_ONE_LINE_PREFIX)


def peer_reported_failure() -> bool:
    """Has another rank of this node already stopped with a one-line failure? Its exit breaks this rank's collectives
    ("connection closed by peer"); that error is only a consequence and must not add a traceback to its line."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    # torchrun's layout: <log_dir>/<run_id>/attempt_<n>/<local_rank>/error.json
    for sibling in Path(error_file).parent.parent.glob(f"*/{Path(error_file).name}"):
        with contextlib.suppress(OSError, ValueError):
            if one_line_failure(json.loads(sibling.read_text()).get("message")):
                return True
    return False
