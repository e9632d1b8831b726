"""Host shared memory for same-host weight movement (CPU): files in /dev/shm mapped by every process that needs them.

On GPU, pieces of a bucket move between trainer ranks over NCCL and reach colocated SGLang engines through CUDA IPC
handles (rollout.sync=cuda_ipc). On CPU, gloo's only intra-host path is TCP over loopback (about a tenth of memcpy
speed here), so the same-host steps of a sync use shared memory instead, with the same shape of protocol: a sender
allocates a bucket slot as a shared file, same-host holders write their pieces straight into it (mpo.rollout.
streaming), and mpo's engine reads the converted bucket in place from a small locator message
(rollout.sync=shm, load_format "mpo_shm") instead of receiving its bytes.

Files are named `mpo-sync-<token>-p<pid>-...` in MPO_SHM_DIR (default /dev/shm), created exclusively, preallocated
with posix_fallocate (a full tmpfs fails here with ENOSPC instead of killing a process with SIGBUS on a later write)
and unlinked by their creator when the sync ends; files of processes that died (SIGKILL) are removed by the next
file created on the host. The engine opens only regular files of that prefix in that
directory, maps them read-only (copy-on-write, so it can never write the trainer's memory) and checks every locator
against the file's size.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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


_OWNER = re.compile(r"^mpo-sync-[0-9a-z]+-p(\d+)-")


def remove_orphans() -> int:
    """Unlink mpo-sync files whose creating process is gone (a killed trainer cannot unlink its slots)."""
    removed = 0
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return 0
    for name in names:
        owner = _OWNER.match(name)
        if owner is None:
            continue
        try:
            os.kill(int(owner.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(shm_dir() / name)
                removed += 1
            except OSError:
                pass
        except PermissionError:  # alive, another user's
            pass
    return removed


class SharedBuffer:
    """A flat tensor in a shared file. `create=True` makes the file (exclusively, preallocated) with `numel` elements;
    otherwise an existing file is mapped whole (a peer's slot; numel from its size). `close()` drops the mapping
    and, for the creator, unlinks the file."""

    def __init__(self, name: str, numel: int | None, dtype: torch.dtype, *, create: bool) -> None:
        if not _NAME.match(name):
            raise ValueError(f"shared buffer name {name!r} must match {_NAME.pattern}")
        self.path = str(shm_dir() / name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel is None:
            numel = os.stat(self.path).st_size // itemsize
        self.numel, self.dtype, self.owner = numel, dtype, create
        nbytes = numel * itemsize
        if create:
            remove_orphans()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                os.close(fd)
                os.unlink(self.path)
                if exc.errno == errno.ENOSPC:
                    raise OSError(errno.ENOSPC, f"no space in {shm_dir()} for a {nbytes >> 20} MiB weight-sync slot "
                                  f"(a container's /dev/shm is often 64 MiB: raise --shm-size, or set MPO_SHM_DIR, "
                                  f"or use rollout.bucket_mb smaller)") from exc
                raise
            os.close(fd)
        self.tensor = torch.from_file(self.path, shared=True, size=numel, dtype=dtype) if numel else \
            torch.empty(0, dtype=dtype)
        key = self.tensor.untyped_storage().data_ptr()
        _REGISTRY[key] = self.path
        self._finalizer = weakref.finalize(self, _release, key, self.path if create else None)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=self.dtype)
        self._finalizer()


def _release(key: int, unlink: str | None) -> None:
    _REGISTRY.pop(key, None)
    if unlink is not None:
        try:
            os.unlink(unlink)
        except FileNotFoundError:
            pass


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
    from mpo.rollout.sglang_wire import dtype_name

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
    head-group axis: mpo.rollout.streaming) as long as it holds as many elements, in the same row-major order."""
    from mpo.rollout.sglang_wire import dtype_from_name

    path = Path(str(locator.get("path", "")))
    if path.parent != shm_dir() or not _NAME.match(path.name):
        raise ValueError(f"path {str(path)!r} is not an {PREFIX}* file in {shm_dir()}")
    dtype = dtype_from_name(str(locator.get("dtype")))
    shape, stride, offset = locator.get("shape"), locator.get("stride"), locator.get("offset")
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    if not (ints(shape) and ints(stride) and len(shape) == len(stride)) or not ints([offset]):
        raise ValueError(f"shape/stride/offset {shape!r}/{stride!r}/{offset!r} must be lists of equal length and an "
                         f"integer, all >= 0")
    if expected_shape is not None and _numel(shape) != _numel(expected_shape):
        raise ValueError(f"shape {tuple(shape)} ({_numel(shape)} elements) differs from the model's "
                         f"{tuple(expected_shape)} ({_numel(expected_shape)} elements)")
    flat = _mapped(path, dtype, cache)
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset - 1
    if last >= flat.numel():
        raise ValueError(f"the view ends at element {last} but {path.name} holds {flat.numel()}")
    if not all(shape):
        return torch.empty(tuple(shape), dtype=dtype)
    return flat.as_strided(tuple(shape), tuple(stride), offset)


def _numel(shape) -> int:
    return torch.Size(shape).numel()


def _mapped(path: Path, dtype: torch.dtype, cache: dict | None) -> torch.Tensor:
    """The whole file as a flat tensor of `dtype`: mapped once per session (`cache`, keyed by name: a slot's name
    belongs to one sync), after checking that the name opened without following a link is a regular file."""
    import mmap
    import stat

    key = (str(path), dtype)
    if cache is not None and key in cache:
        return cache[key]
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # the file checked is the file mapped (no second open by name)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
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

