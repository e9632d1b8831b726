"""Host shared memory for same-host weight movement on CPU (mpo.weight_sync says why, and how: the sender's slots, the
"shm" transport's locators): files in /dev/shm mapped by every process that needs them.

Files are named `mpo-sync-<token>-p<pid>-...` in MPO_SHM_DIR (default /dev/shm), created exclusively, preallocated
with posix_fallocate (a full tmpfs fails here with ENOSPC, one line naming the size and the room left, instead of
killing a process with SIGBUS on a later write) and unlinked by their creator when the sync ends. The creator holds
a shared flock on its file for the file's life; files of processes that died (SIGKILL) are removed by the next file
created on the host, judged by that lock, never by the pid in the name: a trainer in another PID namespace sharing
the directory (a container with --ipc=host) has pids that mean nothing here. The engine opens only regular files of
that prefix in that directory (non-blocking, so a FIFO of that name cannot hang it; the type is checked on the
descriptor), owned by its own effective uid and writable by no one else (a slot another user made, or could rewrite,
would put their bytes into the served weights; the trainer's slots are made 0600), maps them read-only
(copy-on-write, so it can never write the trainer's memory) and checks every locator against the file's size and
every dtype against the ones weights travel in.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import re
import secrets
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpo.lifecycle import NoSpaceLeft

PREFIX = "mpo-sync-"
_NAME = re.compile(r"^mpo-sync-[0-9a-z_-]{1,120}$")
# storage data_ptr -> path of the shared file it maps (this process's SharedBuffers that are alive)
_REGISTRY: dict[int, str] = {}


def shm_dir() -> Path:
    """Where shared files live: MPO_SHM_DIR, else /dev/shm (a tmpfs on Linux)."""
    return Path(os.environ.get("MPO_SHM_DIR") or "/dev/shm")


def new_token() -> str:
    """A random name part for one streamer's files (several trainers on one host never collide)."""
    return secrets.token_hex(6)


def file_name(token: str, *parts: object, pid: int | None = None) -> str:
    """`mpo-sync-<token>-p<creator pid>-<parts...>` (pid: this process): the pid lets a later run remove the files
    of a killed one."""
    return "-".join([f"{PREFIX}{token}", f"p{os.getpid() if pid is None else pid}", *map(str, parts)])


def host_key() -> str:
    """Equal for two processes iff they share this host's shared-memory directory: host name, boot id and the
    directory's device/inode (containers on one host have their own /dev/shm)."""
    import socket

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(shm_dir())
        where = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        return f"{socket.gethostname()}:{boot}:no-shm-{os.getpid()}"  # unique: no sharing without the directory
    return f"{socket.gethostname()}:{boot}:{where}"


STAGING = "mpo-staging-"  # a file being created (mpo-staging-<token>-p<pid>-...), not yet named PREFIX
_OWNER = re.compile(r"^mpo-(sync|staging)-[0-9a-z]+-p(\d+)-")
# Weights travel in these dtypes (the trainer's and the engine's, mpo.config's model.dtype / rollout.engine_dtype);
# a locator naming another one would reinterpret the slot's bytes. float8_e4m3fn: block-FP8 engine weights
# (rollout.engine_weights=fp8_block, mpo.weight_sync.fp8), which the engine takes only with their scales.
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


def _open_regular(path: str | Path, flags: int) -> int:
    """A descriptor of `path` opened without following a link and without blocking (a FIFO's open() waits for a
    writer forever), after checking on the descriptor itself that it is a regular file (ValueError otherwise)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    return fd


def _open_slot(path: str | Path) -> int:
    """A read-only descriptor of a peer's slot: a regular file (_open_regular), owned by this process's effective uid
    and not writable by group or others, all checked on the descriptor; ValueError naming the path and why."""
    fd = _open_regular(path, os.O_RDONLY)
    info = os.fstat(fd)
    problem = None
    if info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    if problem is not None:
        os.close(fd)
        raise ValueError(f"{path} {problem}: refused as a weight slot")
    return fd


def remove_orphans() -> int:
    """Unlink mpo-sync files whose creator is gone: nobody holds the lock every creator keeps on its file while it
    lives (the kernel drops it when the process dies, however it dies, in any PID namespace)."""
    removed = 0
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return 0
    for name in names:
        if _OWNER.match(name) is None:
            continue
        path = shm_dir() / name
        try:
            fd = _open_regular(path, os.O_RDONLY)
        except (OSError, ValueError):  # gone meanwhile, another user's (0600), or not a regular file
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while the creator (or a fork of it) lives
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:  # still the file we judged
                os.unlink(path)
                removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _create_locked(path: str, nbytes: int) -> int:
    """Create `path` exclusively with `nbytes` preallocated and this process's lock on it; returns the descriptor
    (keep it open: closing it drops the lock). The file is made, locked and allocated under a staging name
    (`mpo-staging-...`, which engines never open) and only then linked to its own name, so a sweep never finds it
    there unlocked and a failed allocation leaves no name behind. (An unnamed O_TMPFILE linked in through /proc
    would do the same, but not every kernel lets /proc/self/fd be linked: EXDEV under gVisor.)"""
    directory, name = os.path.split(path)
    staging = os.path.join(directory, STAGING + name[len(PREFIX):])
    for attempt in range(3):
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
            os.link(staging, path)  # EEXIST if the name is taken: exclusive, as O_EXCL
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            if exc.errno == errno.ENOENT and attempt < 2:  # a sweep took the staging file before our lock: again
                continue
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SharedMemoryFull(path, nbytes) from exc
            raise
        os.unlink(staging)
        return fd
    raise AssertionError("unreachable")


class SharedMemoryFull(NoSpaceLeft):
    """The shm directory has no room for a slot: one line (a trainer rank stops with it, as for a full disk) naming
    the size, the room left and the remedies."""

    def __init__(self, path: str, nbytes: int) -> None:
        directory = os.path.dirname(path)
        try:
            info = os.statvfs(directory)
            free = f"{_size(info.f_bavail * info.f_frsize)} free of {_size(info.f_blocks * info.f_frsize)}"
        except OSError:
            free = "free space unknown"
        OSError.__init__(self, errno.ENOSPC, (
            f"no space in {directory} for a {_size(nbytes)} weight-sync slot ({free}; a container's /dev/shm is "
            f"often 64 MiB: raise --shm-size, or set MPO_SHM_DIR, or use sync.bucket_mb smaller)"))
        self.path = Path(path)


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} bytes"


class SharedBuffer:
    """A flat tensor in a shared file. `create=True` makes the file (exclusively, preallocated) with `numel` elements;
    otherwise an existing file is mapped whole (a peer's slot; numel from its size). `close()` drops the mapping
    and, for the creator, unlinks the file."""

    def __init__(self, name: str, numel: int | None, dtype: torch.dtype, *, create: bool) -> None:
        if not _NAME.match(name):
            raise ValueError(f"shared buffer name {name!r} must match {_NAME.pattern}")
        self.path = str(shm_dir() / name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel is None:  # a peer's slot: sized from the file, which must be a regular one
            fd = _open_slot(self.path)
            numel = os.fstat(fd).st_size // itemsize
            os.close(fd)
        self.numel, self.dtype, self.owner = numel, dtype, create
        nbytes = numel * itemsize
        lock = None
        if create:
            remove_orphans()
            lock = _create_locked(self.path, nbytes)  # held until close(): this file's creator is alive
        self.tensor = torch.from_file(self.path, shared=True, size=numel, dtype=dtype) if numel else \
            torch.empty(0, dtype=dtype)
        key = self.tensor.untyped_storage().data_ptr()
        _REGISTRY[key] = self.path
        self._finalizer = weakref.finalize(self, _release, key, self.path if create else None, lock)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=self.dtype)
        self._finalizer()


def _release(key: int, unlink: str | None, lock: int | None) -> None:
    _REGISTRY.pop(key, None)
    if unlink is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(unlink)
    if lock is not None:  # after the unlink: a sweep must never see this file unlocked while it has its name
        os.close(lock)


@dataclass(frozen=True)
class Locator:
    """Where one tensor's values are in a shared file: a strided view, in elements, as torch.as_strided takes it."""

    name: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "dtype": self.dtype, "shape": list(self.shape),
                "stride": list(self.stride), "offset": self.offset}


def locate(name: str, tensor: torch.Tensor) -> Locator | None:
    """The locator of `tensor` when it lies in one of this process's SharedBuffers (a view of a slot), else None."""
    from mpo.weight_sync.wire import dtype_name

    path = _REGISTRY.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None
    if path is None:
        return None
    return Locator(name, path, dtype_name(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()),
                   tensor.storage_offset())


def read_view(locator: dict[str, Any], *, expected_shape: tuple[int, ...] | None = None,
              cache: dict | None = None) -> torch.Tensor:
    """The engine's side: a read-only (copy-on-write) view of the located values, after checking that the file is a
    regular `mpo-sync-*` file directly in shm_dir() and that the view lies inside it. Raises ValueError naming the
    field otherwise. The caller copies the values out before the request returns (the trainer reuses the slot).
    `cache`: mappings by file name, kept by the caller for one weight-update session: a slot mapped once has its
    page tables filled once (mapping anew per tensor made the engine's copy about 3x slower) and is opened and
    checked once. `expected_shape`: the model's shape for this tensor; the view may refine it (q/k/v keep their
    head-group axis: mpo.weight_sync.gather) as long as it holds as many elements, in the same row-major order."""
    from mpo.weight_sync.wire import dtype_from_name

    raw = str(locator.get("path", ""))
    if cache is None or ("checked", raw) not in cache:  # a session's slots are checked once, not once per tensor
        path = Path(raw)
        if path.parent != shm_dir() or not _NAME.match(path.name):
            raise ValueError(f"path {str(path)!r} is not an {PREFIX}* file in {shm_dir()}")
        if cache is not None:
            cache[("checked", raw)] = True
    if locator.get("dtype") not in WEIGHT_DTYPES:
        raise ValueError(f"dtype {locator.get('dtype')} is not a weight dtype ({', '.join(WEIGHT_DTYPES)}): it would "
                         f"reinterpret the slot's bytes")
    dtype = dtype_from_name(locator["dtype"])
    shape, stride, offset = locator.get("shape"), locator.get("stride"), locator.get("offset")
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    if not (ints(shape) and ints(stride) and len(shape) == len(stride)) or not ints([offset]):
        raise ValueError(f"shape/stride/offset {shape!r}/{stride!r}/{offset!r} must be lists of equal length and an "
                         f"integer, all >= 0")
    if expected_shape is not None and _numel(shape) != _numel(expected_shape):
        raise ValueError(f"shape {tuple(shape)} ({_numel(shape)} elements) differs from the model's "
                         f"{tuple(expected_shape)} ({_numel(expected_shape)} elements)")
    flat = _mapped(raw, dtype, cache)
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset - 1
    if last >= flat.numel():
        raise ValueError(f"the view ends at element {last} but {Path(raw).name} holds {flat.numel()}")
    if not all(shape):
        return torch.empty(tuple(shape), dtype=dtype)
    return flat.as_strided(tuple(shape), tuple(stride), offset)


def _numel(shape) -> int:
    return math.prod(shape)  # Python integers: a huge dimension is a number too large, not an overflow error


def _mapped(path: str, dtype: torch.dtype, cache: dict | None) -> torch.Tensor:
    """The whole file as a flat tensor of `dtype`: mapped once per session (`cache`, keyed by name: a slot's name
    belongs to one sync), after checking that the name opened without following a link is a regular file."""
    import mmap

    key = (path, dtype)
    if cache is not None and key in cache:
        return cache[key]
    fd = _open_slot(path)  # the file checked is the file mapped (no second open by name)
    try:
        info = os.fstat(fd)
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel_file = info.st_size // itemsize
        if numel_file == 0:
            return torch.empty(0, dtype=dtype)
        # ACCESS_COPY: a private copy-on-write mapping; the engine only reads and can never write the trainer's
        # pages. frombuffer keeps the mapping alive while a view of it lives.
        mapped = mmap.mmap(fd, numel_file * itemsize, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(mapped, dtype=dtype, count=numel_file)
    finally:
        os.close(fd)
    if cache is not None:
        cache[key] = flat
    return flat

