"""SGLang 0.5.23's weight-update wire pieces, written without importing sglang (the trainer's venv has none).

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
* `dtype_name`: the dtype strings `/update_weights_from_distributed` resolves with `getattr(torch, name)`.
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
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

NamedTensors = Sequence[tuple[str, torch.Tensor]]


def join_weight_update_group(master_address: str, master_port: int, world_size: int, group_name: str,
                             backend: str = "gloo", rank: int = 0,
                             timeout: timedelta = timedelta(seconds=120)) -> dist.ProcessGroup:
    """Join, as `rank` (0 = the trainer, which hosts the TCP store), the group SGLang creates on
    /init_weights_update_group. Blocks until all `world_size` ranks arrived, so the trainer calls it while the
    engines' HTTP requests are in flight."""
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

    sglang's own serializer pickles CPU tensors with ForkingPickler as shared-memory handles. Doing that here needed
    process-wide changes while pickling: the file_system sharing strategy (the fd strategy fails on the server with
    `AuthenticationError`), and the torch_shm_manager it may start outlives us and inherited our stdout/stderr and
    inheritable descriptors (a caller piping our output, or a multiprocessing parent joining us, would hang), so
    stdio was redirected and descriptors made private meanwhile, for every thread. Here the tensor bytes ride in the
    payload instead: no strategy, no manager, no shared-memory file to leak, no effect outside this call, and the
    payload stays valid after the sender exits. The cost is the bytes in the HTTP body (x4/3 for base64), like mpo's
    own engine's safetensors payload; CPU buckets only (flatten_bucket moves them to the CPU)."""
    buf = io.BytesIO()
    # Not ForkingPickler: importing torch.multiprocessing registers shared-memory tensor reductions on it.
    _SGLangPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flattened_bucket_payload(named_tensors: NamedTensors) -> str:
    """The serialized `flattened_bucket` payload of one single-dtype bucket."""
    return serialize_for_sglang(flatten_bucket(named_tensors))
