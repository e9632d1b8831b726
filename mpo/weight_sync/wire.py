"""The weight-update wire (see mpo.weight_sync): bucket payloads and the distributed group's rendezvous.

mpo's engine takes `load_format="mpo_safetensors"` (base64 safetensors bytes: data only, never pickle) and
`"mpo_shm"` (JSON locators into a shared-memory slot, mpo.weight_sync.shared_memory). The rest is SGLang 0.5.23's
wire, written without importing sglang (the trainer's venv has none):

* `join_weight_update_group`: one side of `/init_weights_update_group`. sglang builds that group with
  `sglang.srt.utils.init_custom_process_group`: a TCP-store rendezvous at `tcp://master_address:master_port`, the
  store wrapped in `PrefixStore(group_name, ...)`, then `torch.distributed.distributed_c10d.
  _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, ...)`. We make the same torch
  calls, so the trainer (rank 0, which hosts the TCP store), SGLang's ranks and mpo's engine meet in one group.
* `flatten_bucket` + `serialize_for_sglang`: the `load_format="flattened_bucket"` payload of
  `/update_weights_from_tensor`, i.e. base64 of a pickle of `{"flattened_tensor": t, "metadata": [...]}` (sglang
  pickles with ForkingPickler; serialize_for_sglang says why the tensor bytes travel inline here). sglang builds
  the metadata with its `FlattenedTensorMetadata` dataclass, but the server does not need that class: it unpickles
  with `SafeUnpickler` (an allow-list that admits `types.SimpleNamespace` and torch's tensor/storage rebuilders)
  and `WeightUpdater._update_weights_from_flattened_bucket` reads only the attributes `name, shape, dtype,
  start_idx, end_idx, numel` of each item. So we send `SimpleNamespace`s with those fields.
  (Pickling a reference to the real class is not possible without sglang: pickle must import a class to save it.)
* `pack_bucket` / `unpack_bucket`: a whole bucket as ONE contiguous uint8 buffer plus a manifest, the layout of
  sglang 0.5.23's multi-dtype `FlattenedTensorBucket` (`supports_multi_dtypes`; its receive side allows no padding,
  hence packed_order). One bucket then costs one collective (sglang allocates `FlattenedTensorBucket.empty(names,
  dtypes, shapes)` and receives ONE broadcast into it), one CUDA IPC handle, or one HTTP payload, whatever the
  number of tensors (Qwen3-30B-A3B: ~18k expert tensors per sync, each a latency-bound call before).
"""

from __future__ import annotations

import base64
import io
import pickle
from datetime import timedelta
from types import FunctionType, SimpleNamespace
from typing import Sequence

import torch
import torch.distributed as dist
from safetensors.torch import save as safetensors_save
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

NamedTensors = Sequence[tuple[str, torch.Tensor]]
MPO_FORMAT = "mpo_safetensors"
SHM_FORMAT = "mpo_shm"
SGLANG_FORMAT = "flattened_bucket"


def encode_mpo_bucket(bucket: NamedTensors) -> str:
    # Views (a streaming bucket's tensors share one slot) are copied: safetensors refuses tensors sharing storage.
    return base64.b64encode(safetensors_save({name: t.clone() if t._base is not None else t.contiguous()
                                              for name, t in bucket})).decode("ascii")


def group_layout(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the distributed weight-update group: the trainer is rank 0, engine
    i's TP ranks follow the engines before it. The launcher's plan states the same layout (launch/plan.py)."""
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
    return 1 + sum(tp_sizes), offsets


def host_weight_update_store(master_address: str, world_size: int,
                              timeout: timedelta = timedelta(seconds=120)) -> dist.TCPStore:
    """The trainer's (rank 0's) TCP store for a weight-update group, listening (on every interface, as a rendezvous
    store does) on a port the OS picks (port 0) before any engine is told it (`store.port`): a port picked free first
    and bound later could be taken meanwhile on a busy host."""
    return dist.TCPStore(master_address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def join_weight_update_group(master_address: str, master_port: int, world_size: int, group_name: str,
                             backend: str = "gloo", rank: int = 0, timeout: timedelta = timedelta(seconds=120),
                             store: dist.Store | None = None) -> dist.ProcessGroup:
    """Join, as `rank` (0 = the trainer, which hosts the TCP store), the group SGLang creates on
    /init_weights_update_group. Blocks until all `world_size` ranks arrived, so the trainer calls it while the
    engines' HTTP requests are in flight. The trainer passes the store it already hosts (host_weight_update_store);
    without one, rank 0 binds `master_port` itself."""
    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (what SGLang resolves with getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def split_by_dtype(bucket: NamedTensors) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of one dtype (a flattened bucket holds one dtype), keeping the order."""
    runs: list[list[tuple[str, torch.Tensor]]] = []
    for name, tensor in bucket:
        if runs and runs[-1][0][1].dtype == tensor.dtype:
            runs[-1].append((name, tensor))
        else:
            runs.append([(name, tensor)])
    return runs


def flatten_bucket(named_tensors: NamedTensors, device: torch.device | str = "cpu") -> dict:
    """One flat tensor (one dtype, on `device`) plus per-tensor metadata with the fields of sglang's
    FlattenedTensorMetadata."""
    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        raise ValueError(f"one flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
    metadata, pos = [], 0
    for name, t in named_tensors:
        metadata.append(SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=pos,
                                        end_idx=pos + t.numel(), numel=t.numel()))
        pos += t.numel()
    flat = torch.cat([t.detach().reshape(-1).to(device) for _, t in named_tensors])
    return {"flattened_tensor": flat, "metadata": metadata}


class _SGLangPickler(pickle._Pickler):  # the pure-Python pickler: the only one whose save_global can be extended
    """A plain pickler (CPU tensors travel with their bytes) that names torch's storage loader the way sglang's
    SafeUnpickler admits it. megatron.core replaces `torch.storage._load_from_bytes` with its own
    `safe_load_from_bytes` at import, so plain pickle would name megatron's function, which sglang refuses
    ("Blocked unsafe global") and crashes on. Both load the same bytes, so the payload names torch's."""

    def save_global(self, obj: object, name: str | None = None) -> None:
        if obj is torch.storage._load_from_bytes:
            self.write(pickle.GLOBAL + b"torch.storage\n_load_from_bytes\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)

    # The base class dispatches functions to its own save_global through this table, not by attribute lookup.
    dispatch = {**pickle._Pickler.dispatch, FunctionType: save_global}


def serialize_for_sglang(obj: object) -> str:
    """A payload sglang's `MultiprocessingSerializer.deserialize` reads: base64 of a pickle whose globals its
    `SafeUnpickler` admits (torch's `_rebuild_tensor_v2`, `torch.storage._load_from_bytes`, which it loads with
    weights_only, `types.SimpleNamespace`, `collections.OrderedDict`, torch dtypes and Size).

    sglang's own serializer pickles CPU tensors with ForkingPickler as shared-memory handles, which here would need
    process-wide changes while pickling: the file_system sharing strategy (the fd strategy fails on the server with
    `AuthenticationError`), and a torch_shm_manager that may outlive us holding our stdout/stderr and inheritable
    descriptors (a caller piping our output, or a multiprocessing parent joining us, would hang). Here the tensor bytes
    ride in the payload instead: no strategy, no manager, no shared-memory file to leak, no effect outside this call,
    and the payload stays valid after the sender exits. The cost is the bytes in the HTTP body (x4/3 for base64), like
    mpo's own engine's safetensors payload; CPU buckets only (flatten_bucket moves them to the CPU)."""
    buf = io.BytesIO()
    # Not ForkingPickler: importing torch.multiprocessing registers shared-memory tensor reductions on it.
    _SGLangPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def packed_order(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """The bucket in manifest order: by dtype size, largest first (stable), so that in the back-to-back byte layout
    every tensor starts at a multiple of its own dtype size (sizes are powers of two)."""
    return sorted(named_tensors, key=lambda item: -item[1].element_size())


def manifest_of(specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[list[SimpleNamespace], int]:
    """(manifest, total bytes) of tensors laid back to back in the given order: one SimpleNamespace per tensor with
    the fields of sglang's FlattenedTensorMetadata, offsets in bytes. ValueError for a misaligned offset (the order
    must be packed_order's)."""
    manifest, offset = [], 0
    for name, dtype, shape in specs:
        itemsize = dtype.itemsize
        if offset % itemsize:
            raise ValueError(f"tensor {name!r} ({dtype_name(dtype)}) would start at byte {offset}, not a multiple of "
                             f"{itemsize}: order a flattened bucket by dtype size, largest first")
        nbytes = torch.Size(shape).numel() * itemsize
        manifest.append(SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=offset,
                                        end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    return manifest, offset


def pack_bucket(named_tensors: NamedTensors, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """ONE contiguous uint8 buffer (on `device`, default the first tensor's) holding every tensor of the bucket, and
    its manifest (manifest_of), in packed_order. Strided views (a streaming bucket's q/k/v) are copied into place
    once; nothing else is allocated."""
    ordered = packed_order(named_tensors)
    if not ordered:
        raise ValueError("a flattened bucket needs at least one tensor")
    manifest, total = manifest_of([(name, t.dtype, tuple(t.shape)) for name, t in ordered])
    flat = torch.empty(total, dtype=torch.uint8, device=device if device is not None else ordered[0][1].device)
    for meta, (_, tensor) in zip(manifest, ordered):
        if meta.numel:
            flat[meta.start_idx: meta.end_idx].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return flat, manifest


def unpack_bucket(flat: torch.Tensor, manifest: Sequence[SimpleNamespace]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a packed bucket: views of `flat` (no copy), as sglang's reconstruct_tensors makes."""
    return [(meta.name, flat[meta.start_idx: meta.end_idx].view(meta.dtype).view(meta.shape)) for meta in manifest]


def flattened_bucket_payload(named_tensors: NamedTensors) -> str:
    """The serialized `flattened_bucket` payload of one bucket, every dtype in one buffer (pack_bucket)."""
    flat, manifest = pack_bucket(named_tensors, device="cpu")
    return serialize_for_sglang({"flattened_tensor": flat, "metadata": manifest})


def cuda_ipc_payload(named_tensors: NamedTensors) -> str:
    """A flattened_bucket payload whose tensor travels as a CUDA IPC handle (GPU only; not run on CPU): pickled by
    torch's ForkingPickler, which reduces CUDA tensors to IPC handles, then base64 (sglang's
    MultiprocessingSerializer.serialize(..., output_str=True) writes the same)."""
    from multiprocessing.reduction import ForkingPickler  # torch 2.11 no longer re-exports it from its reductions

    from torch.multiprocessing.reductions import init_reductions

    init_reductions()
    flat, manifest = pack_bucket(named_tensors)  # one buffer on the tensors' GPU: one IPC handle per bucket
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump({"flattened_tensor": flat, "metadata": manifest})
    return base64.b64encode(buf.getvalue()).decode("ascii")
