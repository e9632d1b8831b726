"""Read megatron `torch_dist` checkpoints without running code from them.

A torch_dist directory is untrusted input (downloaded, or shared between users), and torch's reader executes
whatever its pickles say:
  * `.metadata` is read by `FileSystemReader.read_metadata` with plain `pickle.load`;
  * small objects (megatron's `common_state`, layers' `_extra_state`) are stored as pickled bytes and turned back
    into objects by `DefaultLoadPlanner.load_bytes` with `torch.load(weights_only=False)`.
Tensor data is already safe: `FileSystemReader.read_data` loads every tensor chunk with `torch.load(weights_only=True)`.

Here `.metadata` goes through an unpickler that only admits the data classes torch.distributed.checkpoint writes
(and the few torch types they hold), and every stored object must also load under torch's weights-only unpickler
before the planner sees it. `load_sharded` is megatron's `dist_checkpointing.load` with this reader: every mpo load
of a torch_dist directory (trainer, engine, checkpoints_tools) goes through it.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_FILE = ".metadata"

# Every global a `.metadata` pickle may name: what torch's FileSystemWriter and megatron's save write (checked on
# checkpoints from checkpoints_tools and from megatron's dist_checkpointing.save, which adds `all_local_plans`).
# Each is a plain data class, enum or type constructor: building one runs no code from the file.
_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}),
    "torch.serialization": frozenset({"_get_layout"}),  # maps "torch.strided" to the layout object
    "torch": frozenset({"Size"}),  # plus every torch dtype (below)
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


class CheckpointFileError(ValueError):
    """A checkpoint file is unreadable, corrupt, or holds something other than data; the message is one line and
    names the file."""

    def __init__(self, message: str, file: str | Path) -> None:
        super().__init__(f"{message} | file={file}".replace("\n", " "))
        self.file = str(file)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name} (not a torch_dist metadata class)")


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The `Metadata` in a `.metadata` file, unpickled with the allow-list above (never plain pickle), whose storage
    entries all lie in regular files of the checkpoint directory (check_storage)."""
    path = Path(path)
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError as exc:
        raise CheckpointFileError(f"cannot read torch_dist metadata ({exc.strerror})", path) from None
    if not regular:  # a FIFO would block every rank, a device read forever
        raise CheckpointFileError("torch_dist metadata is not a regular file", path)
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except OSError as exc:
        raise CheckpointFileError(f"cannot read torch_dist metadata ({exc.strerror})", path) from None
    except pickle.UnpicklingError as exc:
        raise CheckpointFileError(f"unsafe or corrupt torch_dist metadata: {exc}", path) from None
    except Exception as exc:  # truncated or garbled pickles raise EOFError, ValueError, KeyError, ...
        raise CheckpointFileError(f"corrupt torch_dist metadata ({type(exc).__name__}: {exc})", path) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFileError(f"corrupt torch_dist metadata: holds a {type(metadata).__name__}, not Metadata",
                                  path)
    check_storage(metadata, path.parent, path)
    return metadata


def check_storage(metadata: Metadata, directory: Path, where: Path) -> None:
    """Every storage entry names a regular file inside `directory` and a byte range within it. torch's reader opens
    whatever path `.metadata` names and reads `length` bytes from `offset`: `/dev/zero` with a 3 GiB length read
    3 GiB per object, a FIFO blocked every rank. Checked before any read; each file is looked at once."""
    root = directory.resolve()
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        what = f"storage entry {getattr(index, 'fqn', index)!s:.200}"
        if not isinstance(name, str) or not name or "\x00" in name:
            raise CheckpointFileError(f"corrupt torch_dist metadata: {what} names no file", where)
        if name not in sizes:
            file = (root / name).resolve()
            if file.parent != root and root not in file.parents:
                raise CheckpointFileError(f"corrupt torch_dist metadata: {what} names {name[:200]!r}, outside the "
                                          "checkpoint directory", where)
            try:
                info_stat = os.stat(file)
            except OSError as exc:
                raise CheckpointFileError(f"{what}: missing shard file {name[:200]!r} ({exc.strerror})",
                                          where) from None
            if not stat.S_ISREG(info_stat.st_mode):
                raise CheckpointFileError(f"corrupt torch_dist metadata: {what} names {name[:200]!r}, not a regular "
                                          "file", where)
            sizes[name] = info_stat.st_size
        if (not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0
                or offset + length > sizes[name]):
            raise CheckpointFileError(f"corrupt torch_dist metadata: {what} reads bytes [{offset!s:.30}, "
                                      f"+{length!s:.30}) of {name[:200]!r}, which has {sizes[name]}", where)


def check_object_bytes(data: bytes | io.BytesIO, where: str) -> Any:
    """A stored object unpickled by torch's weights-only unpickler (tensors, containers, primitives only)."""
    buffer = io.BytesIO(data.getvalue() if isinstance(data, io.BytesIO) else data)
    try:
        return torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch's message is a paragraph of advice; the line naming the refused global is the one that matters.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0]).split(". Please")[0]
        raise CheckpointFileError(f"stored object is not plain data or is corrupt ({reason})", where) from None


class _WeightsOnlyBytes:
    """A load planner whose `load_bytes` only ever receives bytes that torch's weights-only unpickler accepts.

    The planner's own load_bytes then unpickles them without restrictions (torch's default), but a pickle that the
    weights-only unpickler completes names only allow-listed globals, so the second load builds the same data."""

    def __init__(self, planner: Any, directory: Path) -> None:
        self._planner, self._directory = planner, directory

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        check_object_bytes(value, f"{self._directory} (object {read_item.storage_index.fqn})")
        value.seek(0)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with a restricted `.metadata` unpickler and weights-only stored objects."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as torch's read_metadata does
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _WeightsOnlyBytes(planner, Path(self.path)))


def _safe_filesystem_reader(checkpoint_dir: str | Path, cache_metadata: bool = False,
                            async_strategy: str = "mcore") -> FileSystemReader:
    """Stands in for megatron's `_get_filesystem_reader` (same signature; metadata caching is not needed here)."""
    return SafeFileSystemReader(checkpoint_dir)


def load_sharded(sharded_state_dict: dict, checkpoint_dir: str | Path, *, strategy: Any = None) -> dict:
    """megatron's `dist_checkpointing.load(sharded_state_dict, checkpoint_dir)`, reading only data from the files.
    `strategy`: a megatron load strategy built on torch_dist's (e.g. FullyParallelLoadStrategyWrapper); its reads go
    through the same safe reader.

    Raises CheckpointFileError (one line, names the file) for unsafe or corrupt metadata and stored objects.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from torch.distributed.checkpoint.api import CheckpointException

    # megatron builds its reader in one function, imported into two modules: both names get the safe reader
    torch_strategy._get_filesystem_reader = _safe_filesystem_reader
    serialization._get_filesystem_reader = _safe_filesystem_reader
    if not (Path(checkpoint_dir) / METADATA_FILE).is_file():
        raise CheckpointFileError("not a torch_dist checkpoint (no .metadata)", checkpoint_dir)
    # Read once up front: inside DCP a refused .metadata is logged with a traceback and retried as rank-local files.
    read_dcp_metadata(Path(checkpoint_dir) / METADATA_FILE)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(checkpoint_dir), sharded_strategy=strategy)
    except CheckpointException as exc:
        raise unwrap_checkpoint_exception(exc, checkpoint_dir) from None


def unwrap_checkpoint_exception(exc: Exception, checkpoint_dir: str | Path) -> CheckpointFileError:
    """DCP wraps whatever a read raised (per rank, with its traceback) in a CheckpointException: the first cause as
    one line (ours unchanged; anything else is corrupt or unreadable data)."""
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointFileError):
            return inner
        text = str(inner).strip().splitlines()
        return CheckpointFileError(f"corrupt or unreadable torch_dist data ({type(inner).__name__}: "
                                   f"{text[0] if text else ''})", checkpoint_dir)
    return CheckpointFileError(f"cannot read torch_dist checkpoint ({exc})", checkpoint_dir)
