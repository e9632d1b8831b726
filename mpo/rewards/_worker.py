"""A RewardPool worker process: ``python -m mpo.rewards._worker NAME PARENT_PID``.

Protocol on stdin / a private copy of stdout: frames of an 8-byte big-endian length and a pickle. The worker sends
("ready", pid) once the reward is imported and warmed up (or ("fatal", message) and exits), then for each
(task_id, completion, answer, metadata) it gets, (task_id, True, reward) or (task_id, False, "Error: message").
It exits at end of input. fd 1 is pointed at stderr so a reward function that prints cannot corrupt the protocol.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import struct
import sys

_HEADER = struct.Struct("!Q")


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


def _die_with_parent(parent_pid: int) -> None:
    # A worker stuck in a reward function never reads the EOF of a dead parent: let the kernel kill it instead.
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def main(argv: list[str]) -> None:
    name, parent_pid = argv[0], int(argv[1])
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        from mpo.rewards.registry import get_reward, warm_up

        fn = get_reward(name)
        warm_up(name)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        write_frame(out, ("fatal", f"{type(e).__name__}: {e}"))
        return
    write_frame(out, ("ready", os.getpid()))
    while True:
        message = read_frame(0)
        if message is None:
            return
        task_id, completion, answer, metadata = message
        try:
            value = float(fn(completion, answer, metadata))
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
            reply = (task_id, True, value)
        except BaseException as e:  # noqa: BLE001 - any failure of the reward is a 0.0 and a counted error
            reply = (task_id, False, f"{type(e).__name__}: {str(e)[:500]}")
        write_frame(out, reply)


if __name__ == "__main__":
    main(sys.argv[1:])
