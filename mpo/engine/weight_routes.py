"""Weight-update endpoints of mpo's engine, with SGLang 0.5.23's session rule: updates arrive between
/begin_weight_update and /end_weight_update and take effect at the end (a unit such as QKV may span buckets).

The transports of mpo.weight_sync are served with SGLang's semantics:
* tensor: /update_weights_from_tensor with `load_format="mpo_safetensors"`;
* shm (a trainer on this host): /update_weights_from_tensor with `load_format="mpo_shm"`, whose payload is a JSON
  list of locators into the sender's shared-memory slot (mpo.weight_sync.shared_memory); the values are copied out
  before the request returns, since the sender reuses the slot for its next bucket;
* distributed: /init_weights_update_group joins the trainer's group with the same rendezvous calls SGLang makes
  (mpo.weight_sync.wire.join_weight_update_group; this engine runs at TP1, so its rank is rank_offset),
  /update_weights_from_distributed receives one broadcast from rank 0 per tensor, in list order, into tensors of the
  announced dtype and shape, or, with `load_format="flattened_bucket"` (what mpo's trainer sends, as SGLang 0.5.23 takes
  it), ONE broadcast of the whole bucket into one uint8 buffer laid out as the trainer packed it
  (mpo.weight_sync.wire.manifest_of: back to back in list order, byte offsets) and unpacked as views; and
  /destroy_weights_update_group leaves the group. Collectives of one group run one at a time, in arrival order;
  different groups (one per sender: pipeline stages push concurrently) run at once, and buckets are staged in any order
  within the session. Received tensors are checked (name, shape) only after every broadcast of the request was received,
  so a bad request never leaves the group out of step.

Block-FP8 weights (rollout.engine_weights=fp8_block, mpo.weight_sync.fp8): a weight that arrives in float8_e4m3fn
(tensor and shm paths) is staged with its `<module>.weight_scale_inv` (float32, one scale per 128 x 128 block) and
dequantized when the session ends (EngineModel.load_hf), so the engine holds exactly dequantize(quantize(w)) in its
own dtype; a weight without its scale, or a scale without its FP8 weight, fails the end of the session and no weight
of it is applied. Only the tensors FP8 checkpoints quantize may arrive in FP8 (mpo.weight_sync.fp8.is_quantized).

Every field of a weight request is checked before it is used (payload count and type, base64, safetensors framing,
dtype, name, shape, weight_version): a malformed request is a 400 naming what is wrong, never a 500 carrying the
decoder's exception.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load

from mpo.engine.server import EngineApp, RequestError
from mpo.rollout.protocol import is_json_int
from mpo.weight_sync.fp8 import FP8_DTYPE, SCALE_SUFFIX, is_quantized, scale_name, scale_shape
from mpo.weight_sync.shared_memory import WEIGHT_DTYPES, read_view
from mpo.weight_sync.wire import (MPO_FORMAT, SGLANG_FORMAT, SHM_FORMAT, dtype_from_name, join_weight_update_group,
                                  manifest_of, unpack_bucket)

_WEIGHT_DTYPES = {getattr(torch, name) for name in WEIGHT_DTYPES}


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    """Weights arrive in a float dtype mpo trains or serves in; any other (int32, float64, ...) is a wrong request,
    never converted silently into the parameters."""
    if dtype not in _WEIGHT_DTYPES:
        raise RequestError(f"weight update: tensor {name!r} has dtype {str(dtype).removeprefix('torch.')}, not a "
                           f"weight dtype ({', '.join(WEIGHT_DTYPES)})")


def _weight_version(body: dict[str, Any], endpoint: str) -> str | int | None:
    """The request's weight_version (SGLang's is a string; mpo's trainer sends str(step)), None when absent."""
    value = body.get("weight_version")
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RequestError(f"{endpoint}: weight_version={value!r} must be a string")
    return value


def _group_name(body: dict[str, Any], endpoint: str) -> str:
    name = body.get("group_name") or "weight_update_group"
    if not isinstance(name, str):
        raise RequestError(f"{endpoint}: group_name={name!r} must be a string")
    return name


def _single_payload(body: dict[str, Any]) -> str:
    """The one serialized payload of an /update_weights_from_tensor request to a TP1 engine."""
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list):
        raise RequestError(f"update_weights_from_tensor: serialized_named_tensors must be a list of strings, got "
                           f"{type(payloads).__name__}")
    if len(payloads) != 1:
        raise RequestError(f"mpo engine runs at TP1: expected 1 serialized payload, got {len(payloads)}")
    if not isinstance(payloads[0], str):
        raise RequestError(f"update_weights_from_tensor: serialized_named_tensors[0] must be a string, got "
                           f"{type(payloads[0]).__name__}")
    return payloads[0]


def _decode_inline(payload: str) -> dict[str, torch.Tensor]:
    """An {MPO_FORMAT} payload: base64 of safetensors bytes (data only). The two decoders' errors are the client's
    mistake (RequestError naming the layer that failed); anything else they raise is the engine's."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:  # ValueError: non-ASCII characters
        raise RequestError(f"{MPO_FORMAT}: the payload is not base64 ({exc})") from None
    try:
        return safetensors_load(raw)
    except SafetensorError as exc:
        raise RequestError(f"{MPO_FORMAT}: the payload is not a safetensors file ({exc})") from None


class WeightRoutes:
    """The weight-update routes of one engine.

    `group_init_timeout_s` bounds /init_weights_update_group: the rendezvous with the trainer's TCP store and the
    group's creation each give up after it (a dead address fails in about that time, not minutes), and the join runs
    without holding the collective lock, so other routes and other groups are never queued behind it.
    """

    def __init__(self, runner: Any, app: EngineApp, *, group_init_timeout_s: float = 60.0) -> None:
        self.runner, self.app = runner, app
        self.group_init_timeout = timedelta(seconds=group_init_timeout_s)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_version: str | None = None
        self.groups: dict[str, dist.ProcessGroup] = {}
        self._joining: set[str] = set()  # group names being joined right now
        self._names_lock = threading.Lock()  # guards groups and _joining
        # one collective at a time per group (its broadcasts arrive in request order); groups are independent gloo
        # communicators, so several senders' buckets are received at once
        self._group_locks: dict[str, threading.Lock] = {}
        self._stage_lock = threading.Lock()  # pending and the receive buffers, shared by concurrent requests
        self._buffers: dict[str, torch.Tensor] = {}  # receive buffers of the distributed path, reused every sync
        self._flat_buffers: dict[tuple, torch.Tensor] = {}  # the same for flattened buckets, by (name, dtype, shape)s
        self._mapped: dict = {}  # shm transport: the sender's slots mapped once per session (dropped at its end)
        self._expected: dict[str, tuple[int, ...]] = runner.mapping.hf_shapes()
        # block-FP8 format: weight_scale_inv name -> its shape, for every weight FP8 checkpoints quantize
        self._scales = {scale_name(n): scale_shape(s) for n, s in self._expected.items() if is_quantized(n, s)}

    def install(self) -> None:
        self.app.add("GET", "/weights_checksum", lambda body: {"checksum": self.runner.checksum()})
        self.app.add("POST", "/update_weights_from_tensor", self.from_tensor)
        self.app.add("POST", "/update_weights_from_disk", self.from_disk)
        self.app.add("POST", "/init_weights_update_group", self.init_group)
        self.app.add("POST", "/update_weights_from_distributed", self.from_distributed)
        self.app.add("POST", "/destroy_weights_update_group", self.destroy_group)
        # the slots are the trainer's: unmapped when the session ends (first: apply may refuse the session)
        self.app.end_hooks.append(self._mapped.clear)
        self.app.end_hooks.append(self.apply)

    def _shape_of(self, name: Any) -> tuple[int, ...]:
        """The shape the model expects for a tensor of the checkpoint format or a block-FP8 scale of one."""
        shape = self._expected.get(name, self._scales.get(name)) if isinstance(name, str) else None
        if shape is None:
            raise RequestError(f"weight update: unknown tensor {name!r} for this model")
        return shape

    def _stage(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            shape = self._shape_of(name)
            if name in self._scales:
                if tensor.dtype != torch.float32:
                    raise RequestError(f"weight update: {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}"
                                       f", block-FP8 scales are float32")
            elif tensor.dtype == FP8_DTYPE:
                if not is_quantized(name, shape):
                    raise RequestError(f"weight update: tensor {name!r} arrived in float8_e4m3fn, but block-FP8 "
                                       f"checkpoints keep it unquantized (embeddings, LM head, norms, routers)")
            else:
                _check_dtype(name, tensor.dtype)
            if tuple(tensor.shape) != shape:
                raise RequestError(f"weight update: tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                                   f"expects {shape}")
        with self._stage_lock:
            self.pending.update(tensors)

    def from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        self.app.require_weight_update_session("update_weights_from_tensor")
        load_format = body.get("load_format")
        if load_format not in (MPO_FORMAT, SHM_FORMAT):
            raise RequestError(f"mpo engine: update_weights_from_tensor takes load_format {MPO_FORMAT!r} "
                               f"(safetensors payloads) or {SHM_FORMAT!r} (shared-memory locators), got "
                               f"{load_format!r}")
        payload = _single_payload(body)
        version = _weight_version(body, "update_weights_from_tensor")
        self._stage(_decode_inline(payload) if load_format == MPO_FORMAT else self._from_shared(payload))
        self.pending_version = version or self.pending_version
        self.app.flush_after_update(body, "update_weights_from_tensor")
        return {"success": True, "message": "Success"}

    def _from_shared(self, payload: Any) -> dict[str, torch.Tensor]:
        """Copy every located tensor out of the sender's shared slot into this engine's receive buffers."""
        try:
            locators = json.loads(payload) if isinstance(payload, str) else None
        except ValueError:
            locators = None
        if not isinstance(locators, list) or not all(isinstance(x, dict) for x in locators):
            raise RequestError(f"{SHM_FORMAT}: the payload must be a JSON list of locator objects")
        received: dict[str, torch.Tensor] = {}
        for i, locator in enumerate(locators):
            name = locator.get("name")
            shape = self._shape_of(name)
            try:
                view = read_view(locator, expected_shape=shape, cache=self._mapped)
            except (ValueError, OSError) as exc:
                raise RequestError(f"{SHM_FORMAT}: locator {i} ({name}): {exc}") from exc
            buffer = self._receive_buffer(name, view.dtype, shape)
            buffer.view(view.shape).copy_(view)  # the view may keep an extra axis (q/k/v's head groups)
            received[name] = buffer
        return received

    # -- distributed transport -----------------------------------------------------------------------------------
    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name, address = body.get("group_name", "weight_update_group"), body.get("master_address")
        port, rank, world_size = body.get("master_port"), body.get("rank_offset"), body.get("world_size")
        for field, value, ok, rule in (
                ("group_name", name, isinstance(name, str) and bool(name), "a non-empty string"),
                ("master_address", address, isinstance(address, str) and bool(address), "a host name or address"),
                ("master_port", port, is_json_int(port) and 0 < port < 65536, "an integer port in [1, 65535]"),
                ("world_size", world_size, is_json_int(world_size) and world_size >= 2, "an integer >= 2"),
                ("rank_offset", rank, is_json_int(rank) and is_json_int(world_size) and 0 < rank < world_size,
                 "an integer in [1, world_size) (rank 0 is the trainer)")):
            if not ok:
                raise RequestError(f"init_weights_update_group: {field}={value!r} must be {rule}")
        backend = body.get("backend") or "gloo"
        if backend != "gloo":
            raise RequestError(f"init_weights_update_group: mpo's engine runs on CPU and needs backend 'gloo', "
                               f"got {backend!r}")
        with self._names_lock:
            if name in self.groups or name in self._joining:
                raise RequestError(f"init_weights_update_group: group {name!r} already exists")
            self._joining.add(name)
        try:
            group = join_weight_update_group(address, port, world_size, name, backend, rank=rank,
                                             timeout=self.group_init_timeout)
            with self._names_lock:
                self.groups[name] = group
        except (RuntimeError, ValueError) as exc:  # torch's DistError/DistNetworkError are RuntimeErrors
            raise RequestError(f"init_weights_update_group {name!r} at {address}:{port} failed (bounded by "
                               f"--group-init-timeout-s {self.group_init_timeout.total_seconds():g}): "
                               f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
        finally:
            with self._names_lock:
                self._joining.discard(name)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        self.app.require_weight_update_session("update_weights_from_distributed")
        group_name = _group_name(body, "update_weights_from_distributed")
        group = self.groups.get(group_name)
        if group is None:
            raise RequestError(f"update_weights_from_distributed: no weight-update group {group_name!r} (call "
                               f"/init_weights_update_group first)")
        load_format = body.get("load_format")
        if load_format not in (None, "direct", SGLANG_FORMAT):
            raise RequestError(f"update_weights_from_distributed: load_format {load_format!r} is not supported by "
                               f"mpo's engine (None or 'direct': one broadcast per tensor; {SGLANG_FORMAT!r}: one "
                               f"per bucket)")
        version = _weight_version(body, "update_weights_from_distributed")  # checked before any broadcast
        names, dtypes, shapes = body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or []
        if not all(isinstance(v, list) for v in (names, dtypes, shapes)):
            raise RequestError("update_weights_from_distributed: names, dtypes and shapes must be lists")
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes and "
                               f"{len(shapes)} shapes")
        specs = []
        for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
            if not isinstance(name, str) or not isinstance(dtype, str):
                raise RequestError(f"update_weights_from_distributed: names[{i}] and dtypes[{i}] must be strings")
            if not isinstance(shape, list) or not all(is_json_int(d) and d >= 0 for d in shape):
                raise RequestError(f"update_weights_from_distributed: shapes[{i}]={shape!r} must be a list of "
                                   f"integers >= 0")
            if dtype == "float8_e4m3fn":  # refused before any broadcast, so the group stays in step
                raise RequestError(f"update_weights_from_distributed: {name!r} is float8_e4m3fn, which gloo cannot "
                                   f"broadcast; send block-FP8 weights over sync.transport 'tensor' or 'shm'")
            try:
                specs.append((name, dtype_from_name(dtype), tuple(shape)))
                _check_dtype(name, specs[-1][1])
            except (ValueError, RequestError) as exc:
                raise RequestError(f"update_weights_from_distributed: dtypes[{i}]: {exc}") from exc
        if load_format == SGLANG_FORMAT:
            if not specs:
                raise RequestError("update_weights_from_distributed: a flattened bucket needs at least one tensor")
            try:
                manifest, total = manifest_of(specs)
            except ValueError as exc:
                raise RequestError(f"update_weights_from_distributed: {exc}") from exc
        received: dict[str, torch.Tensor] = {}
        with self._group_locks.setdefault(group_name, threading.Lock()):
            if load_format == SGLANG_FORMAT:
                # One buffer per bucket, the tensors views of it, staged as they are (apply copies them into the
                # model); the buffer is kept for the same bucket next sync, as _receive_buffer keeps per-tensor ones
                flat = self._flat_buffer(tuple(specs), total)
                dist.broadcast(flat, src=0, group=group)
                received = dict(unpack_bucket(flat, manifest))
            else:
                for tensor_name, dtype, shape in specs:  # the sender broadcasts in this order
                    tensor = self._receive_buffer(tensor_name, dtype, shape)
                    dist.broadcast(tensor, src=0, group=group)
                    received[tensor_name] = tensor
        self._stage(received)
        self.pending_version = version or self.pending_version
        self.app.flush_after_update(body, "update_weights_from_distributed")
        return {"success": True, "message": "Succeeded to update parameter online."}

    def _flat_buffer(self, key: tuple, nbytes: int) -> torch.Tensor:
        """Where a flattened bucket lands: last sync's buffer for the same bucket (names, dtypes, shapes) unless one
        of its tensors is still staged from it."""
        with self._stage_lock:
            buffer = self._flat_buffers.get(key)
            if buffer is None or any(name in self.pending for name, _, _ in key):
                buffer = torch.empty(nbytes, dtype=torch.uint8)
                if all(name in self._expected for name, _, _ in key):
                    self._flat_buffers[key] = buffer
            return buffer

    def _receive_buffer(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Where a broadcast tensor lands: last sync's buffer for that name when it fits (kept after apply), so a
        sync every step reuses memory instead of faulting in a fresh copy of the weights each time."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or tuple(buffer.shape) != shape or name in self.pending:
            buffer = torch.empty(shape, dtype=dtype)
            if name in self._expected or name in self._scales:
                self._buffers[name] = buffer
        return buffer

    def destroy_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name = _group_name(body, "destroy_weights_update_group")
        with self._names_lock:
            group = self.groups.pop(name, None)
        if group is None:
            raise RequestError(f"destroy_weights_update_group: no group {name!r}")
        dist.destroy_process_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    # -- disk ------------------------------------------------------------------------------------------------------
    def from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        from mpo.models.hf_source import ConversionError, HFCheckpoint

        raw = body.get("model_path")
        if not isinstance(raw, str) or not raw:
            raise RequestError(f"update_weights_from_disk: model_path={raw!r} must be a checkpoint directory")
        version = _weight_version(body, "update_weights_from_disk")
        path = Path(raw)
        try:
            with HFCheckpoint.open(path) as ckpt:
                tensors = {name: ckpt.get(name, shape) for name, shape in self._expected.items()}
        except (ConversionError, OSError) as exc:
            raise RequestError(f"update_weights_from_disk: {exc}") from exc
        with self.app.generator.model_lock:
            self.runner.load_hf(tensors)
        self.app.generator.weight_version = version or self.app.generator.weight_version
        self.app.flush_after_update(body, "update_weights_from_disk")
        return {"success": True, "message": f"Succeeded to update model weights from {path}.", "num_paused_requests": 0}

    def apply(self) -> None:
        pending, version = self.pending, self.pending_version
        self.pending, self.pending_version = {}, None  # a refused session leaves nothing behind for the next one
        if not pending:
            return
        for name, tensor in pending.items():  # block-FP8: every FP8 weight with its scale, every scale with its weight
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)] + "weight"
                if weight not in pending or pending[weight].dtype != FP8_DTYPE:
                    raise RequestError(f"end_weight_update: {name!r} arrived without its float8_e4m3fn weight "
                                       f"{weight!r} in this session; no weight of the session was applied")
            elif tensor.dtype == FP8_DTYPE and scale_name(name) not in pending:
                raise RequestError(f"end_weight_update: FP8 weight {name!r} arrived without its "
                                   f"{scale_name(name)!r} in this session; no weight of the session was applied")
        with self.app.generator.model_lock:  # weights and their version change together (tokens are stamped with it)
            self.runner.load_hf(pending)
            if version:
                self.app.generator.weight_version = version
