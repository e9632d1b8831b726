"""Client side of sglang's HTTP contract, written without importing sglang (the main venv does not have it).

* `decode_routed_experts`: `meta_info.routed_experts` is base64 of little-endian int32, shape
  [tokens - 1, num_layers, top_k].
* `join_weight_update_group`: the trainer's side of `/init_weights_update_group`. sglang 0.5.23 builds that group
  with `sglang.srt.utils.init_custom_process_group` (a TCP-store rendezvous at `tcp://master_address:master_port`,
  the store wrapped in `PrefixStore(group_name, ...)`, then `torch.distributed.distributed_c10d.
  _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, ...)`). We do the same
  torch calls here so the client (rank 0, which hosts the TCP store) and the server ranks meet in one group.
* `flatten_bucket` + `serialize_for_sglang`: the `load_format="flattened_bucket"` payload of `/update_weights_from_tensor`, i.e.
  base64 of a `ForkingPickler` pickle of `{"flattened_tensor": t, "metadata": [...]}`. sglang builds the metadata
  with its `FlattenedTensorMetadata` dataclass, but the server does not need that class: it unpickles with
  `SafeUnpickler` (an allow-list that admits `types.SimpleNamespace` and torch's tensor/storage rebuilders) and
  `WeightUpdater._update_weights_from_flattened_bucket` reads only the attributes `name, shape, dtype, start_idx,
  end_idx, numel` of each item, converting them to its own dataclass. So the client sends `SimpleNamespace`s with
  those fields and never imports sglang. (Pickling a reference to the real class is not possible here: pickle
  must import a class to save it, and payloads that import it indirectly, e.g. via `importlib.import_module`,
  are refused by the allow-list.)
"""
from __future__ import annotations

import base64
import io
import json
import os
from multiprocessing.reduction import ForkingPickler
import urllib.error
import urllib.request
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing  # registers the tensor reductions with ForkingPickler
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

def http_json(url: str, payload: dict | None = None, headers: dict[str, str] | None = None,
              timeout: float = 120.0) -> tuple[int, dict]:
    """POST `payload` as JSON (GET when None); return (HTTP status, decoded body). Error statuses do not raise."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {"raw": body.decode(errors="replace")}


def decode_routed_experts(b64: str, num_layers: int, top_k: int) -> np.ndarray:
    """mpo's wire-format decoder, with the row count taken from the payload size."""
    from mpo.rollout.protocol import decode_routed_experts as decode

    rows = len(base64.b64decode(b64)) // (4 * num_layers * top_k)
    return decode(b64, rows=rows, num_layers=num_layers, topk=top_k)


def join_weight_update_group(
    master_address: str, master_port: int, world_size: int, group_name: str, backend: str = "gloo",
    rank: int = 0, timeout: timedelta = timedelta(seconds=120),
) -> dist.ProcessGroup:
    """Join (as `rank`, 0 = the trainer) the process group the server creates on /init_weights_update_group.

    Call it while the HTTP request is in flight (the server blocks in the same rendezvous)."""
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
        group_name=group_name, timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def flattened_tensor_metadata(name: str, t: torch.Tensor, start_idx: int) -> SimpleNamespace:
    """One entry of the bucket's metadata: the fields of sglang's `FlattenedTensorMetadata` dataclass."""
    return SimpleNamespace(
        name=name, shape=t.shape, dtype=t.dtype, start_idx=start_idx, end_idx=start_idx + t.numel(), numel=t.numel()
    )


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """Concatenate tensors (one dtype) into one flat tensor plus per-tensor metadata, as sglang's bucket expects."""
    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        raise ValueError(f"one bucket holds one dtype, got {dtypes}")
    metadata, pos = [], 0
    for name, t in named_tensors:
        metadata.append(flattened_tensor_metadata(name, t, pos))
        pos += t.numel()
    flat = torch.cat([t.detach().reshape(-1).cpu() for _, t in named_tensors])
    return {"flattened_tensor": flat, "metadata": metadata}


@contextmanager
def _stdio_to_devnull() -> Iterator[None]:
    """Sharing a CPU tensor with the file_system strategy may start `torch_shm_manager`, which inherits our stdout
    and stderr and outlives us; a caller that pipes our output would then hang. Give it /dev/null instead."""
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def serialize_for_sglang(obj: object) -> str:
    """What sglang's `MultiprocessingSerializer.serialize(obj, output_str=True)` produces: base64 of ForkingPickler
    bytes. CPU tensors travel as shared-memory files (file_system strategy: the default fd strategy makes the
    server fail with `AuthenticationError: digest sent was rejected`). The strategy is set only while pickling
    (the caller's own multiprocessing keeps its default); each shared storage is incref'd by torch for the receiver,
    so the payload stays valid after `obj` is dropped."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    try:
        with _stdio_to_devnull():
            ForkingPickler(buf).dump(obj)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")
