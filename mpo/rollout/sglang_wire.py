"""SGLang 0.5.23's weight-update wire pieces, written without importing sglang (the trainer's venv has none).

* `join_weight_update_group`: one side of `/init_weights_update_group`. sglang builds that group with
  `sglang.srt.utils.init_custom_process_group`: a TCP-store rendezvous at `tcp://master_address:master_port`, the
  store wrapped in `PrefixStore(group_name, ...)`, then `torch.distributed.distributed_c10d.
  _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, ...)`. We make the same torch
  calls, so the trainer (rank 0, which hosts the TCP store), SGLang's ranks and mpo's engine meet in one group.
* `flatten_bucket` + `serialize_for_sglang`: the `load_format="flattened_bucket"` payload of
  `/update_weights_from_tensor`, i.e. base64 of a `ForkingPickler` pickle of `{"flattened_tensor": t, "metadata":
  [...]}`. sglang builds the metadata with its `FlattenedTensorMetadata` dataclass, but the server does not need
  that class: it unpickles with `SafeUnpickler` (an allow-list that admits `types.SimpleNamespace` and torch's
  tensor/storage rebuilders) and `WeightUpdater._update_weights_from_flattened_bucket` reads only the attributes
  `name, shape, dtype, start_idx, end_idx, numel` of each item. So we send `SimpleNamespace`s with those fields.
  (Pickling a reference to the real class is not possible without sglang: pickle must import a class to save it.)
* `dtype_name`: the dtype strings `/update_weights_from_distributed` resolves with `getattr(torch, name)`.
"""

from __future__ import annotations

import base64
import io
import os
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler
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


def flatten_bucket(named_tensors: NamedTensors) -> dict:
    """One flat tensor (one dtype) plus per-tensor metadata with the fields of sglang's FlattenedTensorMetadata."""
    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        raise ValueError(f"one flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
    metadata, pos = [], 0
    for name, t in named_tensors:
        metadata.append(SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=pos,
                                        end_idx=pos + t.numel(), numel=t.numel()))
        pos += t.numel()
    flat = torch.cat([t.detach().reshape(-1).cpu() for _, t in named_tensors])
    return {"flattened_tensor": flat, "metadata": metadata}


@contextmanager
def _shm_manager_inherits_nothing() -> Iterator[None]:
    """Sharing a CPU tensor with the file_system strategy may start `torch_shm_manager`, which outlives us (it
    stays while the engine holds the shared storages). It would inherit our stdout/stderr (a caller piping our
    output would hang) and every inheritable descriptor, e.g. the pipe whose closing tells a multiprocessing parent
    that we exited (its join would hang). So while it may start: stdio goes to /dev/null and no descriptor is
    inheritable; both are restored afterwards."""
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    made_private = []
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        for fd in map(int, os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else ():
            try:
                if fd > 2 and os.get_inheritable(fd):
                    os.set_inheritable(fd, False)
                    made_private.append(fd)
            except OSError:  # the listing's own descriptor, already closed
                pass
        yield
    finally:
        for fd in made_private:
            try:
                os.set_inheritable(fd, True)
            except OSError:
                pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def serialize_for_sglang(obj: object) -> str:
    """What sglang's `MultiprocessingSerializer.serialize(obj, output_str=True)` produces: base64 of ForkingPickler
    bytes. CPU tensors travel as shared-memory files (file_system strategy: with the default fd strategy the server
    fails with `AuthenticationError: digest sent was rejected`). The strategy is set only while pickling; each
    shared storage is incref'd by torch for the receiver, so the payload stays valid after `obj` is dropped."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    try:
        with _shm_manager_inherits_nothing():
            ForkingPickler(buf).dump(obj)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flattened_bucket_payload(named_tensors: NamedTensors) -> str:
    """The serialized `flattened_bucket` payload of one single-dtype bucket."""
    return serialize_for_sglang(flatten_bucket(named_tensors))
