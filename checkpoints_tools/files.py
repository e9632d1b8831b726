"""The converter's output directory, written atomically by one converter at a time (JSON inputs are read by
mpo.models.hf_source.read_json, failing in one line).

Output: a conversion writes into `.NAME.tmp-PID` next to the target and renames it at the end, so a failure never
leaves a partial checkpoint. The target is locked (flock on `.NAME.lock`, removed when done) for the whole
conversion, so a second converter into the same target fails at once, naming the holder; while holding the lock,
temporary directories left by killed converters (their PID is no longer running) are removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import sys
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

from mpo.models.hf_source import ConversionError


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove_stale_temporaries(target: Path) -> None:
    """`.NAME.tmp-PID` directories of converters that died (SIGKILL, power loss) before cleaning up."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.tmp-(\d+)$")
    for path in target.parent.iterdir():
        match = pattern.match(path.name)
        if match and path.is_dir() and not _pid_running(int(match.group(1))):
            print(f"checkpoints_tools: removing {path} left by a converter that is no longer running (pid "
                  f"{match.group(1)})", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def target_lock(target: Path) -> Iterator[None]:
    """Exclusive, non-blocking lock on `target` (flock on `.NAME.lock` beside it, holding the holder's PID)."""
    lock_path = target.parent / f".{target.name}.lock"
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConversionError(f"cannot write beside the output directory ({exc.strerror})",
                                  file=str(target.parent)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            try:
                holder = lock_path.read_text().strip() or "?"
            except OSError:
                holder = "?"
            raise ConversionError(f"another conversion (pid {holder}) is writing this output directory",
                                  file=str(target)) from None
        # The previous holder unlinks the lock file on release; if we locked an unlinked file, try again.
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with suppress(FileNotFoundError):
            os.unlink(lock_path)  # while still holding the lock: a waiter that opened it retries (above)
        os.close(fd)


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """A fresh temporary directory next to `target`, renamed to `target` only if the body succeeds.

    Raises ConversionError (one line) if the target is a file or a non-empty directory, if its parent cannot be
    written, or if another converter holds the target.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise ConversionError("output path exists and is not a directory", file=str(target))
    if target.is_dir() and any(target.iterdir()):
        raise ConversionError("output directory exists and is not empty", file=str(target))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConversionError(f"cannot create the output's parent directory ({exc.strerror})",
                              file=str(exc.filename or target.parent)) from None
    with target_lock(target):
        _remove_stale_temporaries(target)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
            if target.exists():
                if any(target.iterdir()):  # created while we converted (outside the lock)
                    raise ConversionError("output directory appeared and is not empty", file=str(target))
                target.rmdir()
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
