"""Write and read megatron-core `torch_dist` checkpoints in one process, one tensor slice at a time.

Writing: torch.distributed.checkpoint (DCP) with a planner whose write items are declared up front (key, global
shape, chunk offsets) and whose data is produced lazily, item by item, when DCP's writer asks for it. Every
per-layer / per-expert unit becomes its own DCP chunk, so no stacked [L, E, ...] tensor is ever materialised and
memory stays near one unit (the largest is the vocabulary embedding). The result is what megatron's
`dist_checkpointing.save` writes at TP1 (checked by the tests): `.metadata`, `__0_0.distcp`, `metadata.json`, the
`common_state` object (an empty common dict) and the `_extra_state` objects of the local spec's linear layers.

Reading: DCP metadata (unpickled with mpo.safe_load's allow-list, never plain pickle) says which chunks (file, byte
range) hold which region of each global tensor; a region is assembled from the overlapping chunks, each deserialised
with `torch.load(weights_only=True)` (DCP stores every tensor chunk with torch.save). Works for checkpoints written
by megatron at any layout and by this module.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from mpo.models.hf_source import ConversionError

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
COMMON_STATE_KEY = "common_state/shard_0_1"  # megatron: ShardedObject("common_state", ..., (1,), (0,)).unique_key


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of one global tensor, produced on demand.

    Attributes:
        key: torch_dist key.
        global_shape: shape of the whole tensor.
        offsets: where the chunk starts in every dimension.
        sizes: chunk shape (same rank as the global tensor).
        dtype: stored dtype.
        produce: returns the chunk's data (shape `sizes` or without its leading singleton axes).
    """

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


def _object_bytes(obj) -> io.BytesIO:
    """A ShardedObject's payload as megatron stores it: torch.save of a one-element list."""
    buffer = io.BytesIO()
    torch.save([obj], buffer)
    buffer.seek(0)
    return buffer


def write_torch_dist(directory: Path, chunks: Iterable[ChunkSpec], objects: dict[str, object],
                     on_chunk: Callable[[ChunkSpec], None] | None = None) -> None:
    """Write a torch_dist checkpoint into `directory` (which must exist and be empty) from lazy chunks.

    `objects` maps ShardedObject unique keys to their (picklable by weights_only rules) payloads.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    by_index: dict[MetadataIndex, ChunkSpec] = {}
    items: list[WriteItem] = []
    for chunk in chunks:
        index = MetadataIndex(chunk.key, torch.Size(chunk.offsets))
        items.append(WriteItem(
            index=index, type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(chunk.global_shape))))
        by_index[index] = chunk
    all_objects = {COMMON_STATE_KEY: {}, **objects}
    for key in all_objects:
        items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))

    class LazyPlanner(DefaultSavePlanner):
        """A DefaultSavePlanner whose plan is given and whose data is computed when written."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                             dedup_save_to_lowest_rank=False)

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            self.state_dict, self.is_coordinator = state_dict, is_coordinator

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: WriteItem):
            if write_item.type == WriteItemType.BYTE_IO:
                return _object_bytes(all_objects[write_item.index.fqn])
            chunk = by_index[write_item.index]
            data = chunk.produce().to(chunk.dtype).reshape(chunk.sizes).contiguous()
            if on_chunk is not None:
                on_chunk(chunk)
            return data

    import warnings

    from torch.distributed.checkpoint.api import CheckpointException

    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1, sync_files=True)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({}, storage_writer=writer, planner=LazyPlanner(), no_dist=True)
    except CheckpointException as exc:
        # DCP wraps errors raised while producing data; surface ours (one line, names file and tensor).
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, ConversionError):
                raise inner from None
        raise
    (directory / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


class TorchDistReader:
    """Region reads from a torch_dist checkpoint directory without megatron or a process group."""

    def __init__(self, directory: str | Path) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        from mpo.models.hf_source import read_json
        from mpo.safe_load import CheckpointFileError, read_dcp_metadata

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConversionError("torch_dist checkpoint directory does not exist", file=str(self.directory))
        if not (self.directory / ".metadata").is_file():
            raise ConversionError("not a torch_dist checkpoint (no .metadata)", file=str(self.directory))
        metadata_json = self.directory / "metadata.json"
        if metadata_json.is_file():
            backend = read_json(metadata_json).get("sharded_backend")
            if backend != "torch_dist":
                raise ConversionError(f"sharded_backend={backend!r}, expected torch_dist", file=str(metadata_json))
        try:  # never plain pickle: .metadata is untrusted (mpo.safe_load)
            self.metadata = read_dcp_metadata(self.directory / ".metadata")
        except CheckpointFileError as exc:
            raise ConversionError(str(exc)) from None
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self.objects = [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
        self._storage: dict[str, list] = {}
        for index, info in self.metadata.storage_data.items():
            self._storage.setdefault(index.fqn, []).append((index, info))

    def shape(self, key: str) -> tuple[int, ...] | None:
        meta = self.tensors.get(key)
        return tuple(meta.size) if meta is not None else None

    def read(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None
             ) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of tensor `key` (default: all of it)."""
        meta = self.tensors.get(key)
        if meta is None:
            raise ConversionError("tensor not in the torch_dist checkpoint", file=str(self.directory / ".metadata"),
                                  tensor=key)
        shape = tuple(meta.size)
        offsets = offsets or (0,) * len(shape)
        sizes = sizes or shape
        out = torch.empty(sizes, dtype=meta.properties.dtype)
        covered = 0
        for chunk_index, chunk in enumerate(meta.chunks):
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
            hi = [min(o + s, c + n) for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            data = self._load_chunk(key, chunk, chunk_index)
            src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            out[dst] = data[src]
            covered += int(torch.tensor([b - a for a, b in zip(lo, hi)]).prod())
        if covered != out.numel():
            raise ConversionError(f"checkpoint chunks cover {covered} of {out.numel()} elements of the region",
                                  file=str(self.directory), tensor=key)
        return out

    def _load_chunk(self, key: str, chunk, chunk_index: int) -> torch.Tensor:
        candidates = self._storage.get(key, [])
        match = [info for index, info in candidates if tuple(index.offset or ()) == tuple(chunk.offsets)]
        if not match:
            raise ConversionError("chunk listed in .metadata has no storage entry", file=str(self.directory),
                                  tensor=key)
        data = self._stored_bytes(key, match[0])
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated or garbled chunk: torch raises many types
            raise ConversionError(f"corrupt torch_dist data ({type(exc).__name__})",
                                  file=str(self.directory / match[0].relative_path), tensor=key) from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(chunk.sizes):
            raise ConversionError(f"corrupt torch_dist data: chunk is not a tensor of shape {tuple(chunk.sizes)}",
                                  file=str(self.directory / match[0].relative_path), tensor=key)
        return tensor

    def _stored_bytes(self, key: str, info) -> bytes:
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(f"storage transforms {info.transform_descriptors} are not supported",
                                  file=str(self.directory / info.relative_path), tensor=key)
        path = self.directory / info.relative_path
        if not path.is_file():
            raise ConversionError("torch_dist data file is missing", file=str(path), tensor=key)
        with open(path, "rb") as handle:
            handle.seek(info.offset)
            payload = handle.read(info.length)
        if len(payload) != info.length:
            raise ConversionError(f"torch_dist data file is truncated ({len(payload)} of {info.length} bytes at "
                                  f"offset {info.offset})", file=str(path), tensor=key)
        return payload

    def check_objects(self) -> None:
        """Every stored object (megatron common_state, _extra_state) must be plain data: the weights-only unpickler
        must accept it. megatron's loader unpickles these without restrictions, so check before handing it the
        directory (they are small)."""
        from mpo.safe_load import CheckpointFileError, check_object_bytes

        for key in self.objects:
            for index, info in self._storage.get(key, []):
                try:
                    check_object_bytes(self._stored_bytes(key, info), str(self.directory / info.relative_path))
                except CheckpointFileError as exc:
                    raise ConversionError(str(exc), tensor=key) from None
