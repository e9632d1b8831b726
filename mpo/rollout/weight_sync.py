"""In-place weight sync, trainer -> engines, after each optimizer step.

The trainer gathers its TP/PP/EP shards into full tensors (mpo.models.full_state), converts megatron names to Hugging
Face names with the same mapping checkpoints_tools uses, packs them into buckets of a configurable size and pushes
them inside SGLang's weight-update session (pause -> begin -> buckets -> end -> continue). Then it verifies: mpo's
engine reports a checksum of its weights that must equal the trainer's; SGLang has no such endpoint for MoE models,
so the caller compares the log-probs of a fixed probe sequence instead (verify_by_probe).

Two transports, for both engine kinds (config `rollout.sync`):
* "tensor": each bucket travels in the HTTP body of /update_weights_from_tensor. mpo's engine takes
  `load_format="mpo_safetensors"` (base64 safetensors bytes: data only, never pickle); SGLang takes
  `load_format="flattened_bucket"` (one dtype per bucket, shared-memory tensors; see mpo.rollout.sglang_wire).
* "distributed": once per engine set the trainer (rank 0, hosting the rendezvous) and every engine rank join one
  process group (/init_weights_update_group; engine i's ranks start at 1 + the TP sizes of the engines before it;
  gloo on CPU, NCCL on GPU). Per bucket every engine gets /update_weights_from_distributed (names, dtypes, shapes)
  in a thread while rank 0 broadcasts each tensor, in order, on that group.
Both run inside SGLang's weight-update session (pause -> begin -> buckets -> end -> continue).
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from mpo.parallel.ports import free_port
from mpo.rollout.client import EngineClient, EngineError
from mpo.rollout.sglang_wire import dtype_name, flattened_bucket_payload, join_weight_update_group, split_by_dtype

MPO_FORMAT = "mpo_safetensors"
SGLANG_FORMAT = "flattened_bucket"
NamedTensors = list[tuple[str, torch.Tensor]]
EngineKind = Literal["mpo", "sglang"]
Transport = Literal["tensor", "distributed"]


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, fp32 bytes) of HF-named tensors in name order: equal iff every weight has the same value.

    Values are upcast to fp32 first (exact for bf16), so a bf16 engine can be checked against an fp32 trainer whose
    weights are rounded the way the engine stores them (see WeightSync.verify).
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        data = tensor.detach().float().contiguous().cpu()
        digest.update(name.encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def make_buckets(named: NamedTensors, bucket_bytes: int) -> list[NamedTensors]:
    """Consecutive groups of at most bucket_bytes each (a larger single tensor gets a bucket of its own)."""
    buckets: list[NamedTensors] = []
    current: NamedTensors = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def encode_mpo_bucket(bucket: NamedTensors) -> str:
    return base64.b64encode(safetensors_save({name: t.contiguous() for name, t in bucket})).decode("ascii")


def decode_mpo_bucket(payload: str) -> dict[str, torch.Tensor]:
    return safetensors_load(base64.b64decode(payload))


@dataclass
class SyncReport:
    seconds: float
    bytes: int
    buckets: int
    transport: str = "tensor"

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9)

    def metrics(self) -> dict[str, float]:
        return {"sync_time_s": self.seconds, "sync_bytes": float(self.bytes), "sync_bytes_per_s": self.bytes_per_s}




def group_layout(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the distributed weight-update group: the trainer is rank 0, engine
    i's TP ranks follow the engines before it. The launcher's plan states the same layout (launch/plan.py)."""
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
    return 1 + sum(tp_sizes), offsets


class _Calls:
    """HTTP calls to several engines in threads, so the trainer can take part in a collective meanwhile."""

    def __init__(self, clients: Sequence[EngineClient], call: Callable[[EngineClient], Any]) -> None:
        self.errors: dict[str, BaseException] = {}
        self.threads = [threading.Thread(target=self._run, args=(client, call), daemon=True) for client in clients]
        for thread in self.threads:
            thread.start()

    def _run(self, client: EngineClient, call: Callable[[EngineClient], Any]) -> None:
        try:
            call(client)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.errors[client.url] = exc

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def raise_first(self) -> None:
        for exc in self.errors.values():
            raise exc

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.raise_first()
        if not self.done():
            raise TimeoutError(f"engine calls did not return within {timeout_s:.0f} s")


class WeightSync:
    """Pushes HF-named weights to every engine of one kind over one transport, and verifies them.

    Args:
        clients: the engines (all of `engine` kind).
        engine: "mpo" or "sglang": picks the tensor-path payload and the verification.
        transport: "tensor" or "distributed" (module docstring).
        bucket_bytes: bucket size.
        tp_sizes: TP size of each engine (distributed ranks; tensor payloads are sent once per TP rank).
        backend: process-group backend for "distributed" (default: nccl when CUDA is available, else gloo).
        master_address: address the engines reach the trainer's rendezvous at.
        timeout_s: how long a collective step may take before the sync fails.
    """

    def __init__(self, clients: Sequence[EngineClient], *, engine: EngineKind = "mpo", transport: Transport = "tensor",
                 bucket_bytes: int = 64 << 20, tp_sizes: Sequence[int] | None = None, backend: str | None = None,
                 master_address: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        if engine not in ("mpo", "sglang"):
            raise ValueError(f"engine must be 'mpo' or 'sglang', got {engine!r}")
        if transport not in ("tensor", "distributed"):
            raise ValueError(f"transport must be 'tensor' or 'distributed', got {transport!r}")
        self.clients = list(clients)
        self.engine, self.transport, self.bucket_bytes = engine, transport, bucket_bytes
        self.tp_sizes = list(tp_sizes or [1] * len(self.clients))
        if len(self.tp_sizes) != len(self.clients):
            raise ValueError(f"{len(self.tp_sizes)} tp_sizes for {len(self.clients)} engines")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address, self.timeout_s = master_address, timeout_s
        self.group: torch.distributed.ProcessGroup | None = None
        self.group_name = f"mpo_weight_sync_{uuid.uuid4().hex[:8]}"

    # -- pushing ---------------------------------------------------------------------------------------------------
    def push(self, named: NamedTensors, version: str) -> SyncReport:
        """Every tensor of `named` to every engine, in one weight-update session tagged `version`."""
        started = time.perf_counter()
        if self.transport == "distributed" and self.group is None:
            self.connect()
        buckets = make_buckets(named, self.bucket_bytes)
        for client in self.clients:
            client.pause_generation(mode="in_place")
            client.begin_weight_update()
        try:
            for bucket in buckets:
                if self.transport == "tensor":
                    self._push_tensor(bucket, version)
                else:
                    self._push_distributed(bucket, version)
        finally:
            for client in self.clients:
                client.end_weight_update()
                client.continue_generation()
        total = sum(t.numel() * t.element_size() for _, t in named)
        return SyncReport(time.perf_counter() - started, total, len(buckets), self.transport)

    def _push_tensor(self, bucket: NamedTensors, version: str) -> None:
        if self.engine == "mpo":
            payloads = [(MPO_FORMAT, encode_mpo_bucket(bucket))]
        else:
            payloads = [(SGLANG_FORMAT, flattened_bucket_payload(run)) for run in split_by_dtype(bucket)]
        for load_format, payload in payloads:
            for client, tp in zip(self.clients, self.tp_sizes):
                client.update_weights_from_tensor([payload] * tp, load_format=load_format, weight_version=version)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def _push_distributed(self, bucket: NamedTensors, version: str) -> None:
        names = [name for name, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        calls = _Calls(self.clients, lambda c: c.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=self.group_name, weight_version=version))
        device = self._device()
        sent = [t.detach().to(device).contiguous() for _, t in bucket]  # alive until every broadcast completed
        works = [torch.distributed.broadcast(t, src=0, group=self.group, async_op=True) for t in sent]
        # An engine that refuses before receiving (e.g. an unknown group) would leave the broadcasts waiting:
        # poll both, and fail with the engine's own error as soon as one comes back.
        deadline = time.monotonic() + self.timeout_s
        while not (calls.done() and all(w.is_completed() for w in works)):
            if calls.errors and not all(w.is_completed() for w in works):
                self.group = None  # the group is out of step now; the next push makes a new one
                calls.raise_first()
            if time.monotonic() > deadline:
                raise EngineError(self.clients[0].url, "/update_weights_from_distributed",
                                  f"bucket of {len(names)} tensors not done after {self.timeout_s:.0f} s")
            time.sleep(0.001)
        calls.raise_first()

    # -- the process group (distributed transport) ----------------------------------------------------------------
    def connect(self) -> None:
        """Create the weight-update group: trainer rank 0 plus every engine rank (engine i from rank_offset)."""
        port = free_port()
        world_size, offsets = group_layout(self.tp_sizes)
        by_url = dict(zip((c.url for c in self.clients), offsets))
        calls = _Calls(self.clients, lambda c: c.init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=by_url[c.url], world_size=world_size,
            group_name=self.group_name, backend=self.backend))
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = join_weight_update_group(self.master_address, port, world_size, self.group_name,
                                                           backend=self.backend, rank=0,
                                                           timeout=timedelta(seconds=self.timeout_s))
            except BaseException as exc:  # noqa: BLE001
                joined["error"] = exc

        trainer = threading.Thread(target=join, daemon=True)
        trainer.start()
        deadline = time.monotonic() + self.timeout_s
        while trainer.is_alive() or not calls.done():
            if calls.errors:
                calls.raise_first()
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight-update group {self.group_name}: not all of {world_size} ranks joined "
                                   f"within {self.timeout_s:.0f} s")
            time.sleep(0.01)
        calls.raise_first()
        if "error" in joined:
            raise joined["error"]
        self.group = joined["group"]

    def close(self) -> None:
        """Tear the weight-update group down on the engines and here (distributed transport)."""
        if self.group is None:
            return
        try:
            for client in self.clients:
                client.call("/destroy_weights_update_group", {"group_name": self.group_name})
        finally:
            torch.distributed.destroy_process_group(self.group)
            self.group = None

    # -- verification ----------------------------------------------------------------------------------------------
    def verify(self, named: NamedTensors, *, engine_dtype: torch.dtype = torch.float32,
               fp32_names: set[str] = frozenset()) -> None:
        """mpo engines: their checksum must equal the trainer's weights as the engine stores them (cast to
        engine_dtype, except fp32_names such as an FP32 LM head). Raises EngineError naming the engine otherwise."""
        expected = weights_checksum((name, t if name in fp32_names else t.to(engine_dtype)) for name, t in named)
        for client in self.clients:
            got = client.call("/weights_checksum", method="GET")["checksum"]
            if got != expected:
                raise EngineError(client.url, "/weights_checksum", f"weights differ from the trainer's after sync "
                                  f"(engine {got[:12]}, trainer {expected[:12]})", retryable=False)

    def verify_by_probe(self, probe_ids: Sequence[int], trainer_logprobs: Sequence[float], *,
                        tolerance: float = 1e-3) -> float:
        """SGLang engines (no weights checksum for MoE models): each engine's log-probs of the probe sequence must
        be within `tolerance` of the trainer's. `trainer_logprobs[i]` is log p(probe[i] | probe[:i]); position 0
        has none and is ignored. Returns the largest |diff| over engines; raises EngineError naming the engine."""
        if len(trainer_logprobs) != len(probe_ids):
            raise ValueError(f"{len(trainer_logprobs)} trainer log-probs for a probe of {len(probe_ids)} tokens")
        reference = torch.tensor([float(x) for x in trainer_logprobs[1:]], dtype=torch.float64)
        worst = 0.0
        for client in self.clients:
            got = torch.tensor(probe_logprobs(client, probe_ids), dtype=torch.float64)
            diff = (got - reference).abs().max().item()
            if not diff <= tolerance:  # NaN fails too
                raise EngineError(client.url, "/generate", f"probe log-probs differ from the trainer's by {diff:.3g} "
                                  f"(tolerance {tolerance:g}) after weight sync", retryable=False)
            worst = max(worst, diff)
        return worst


def probe_logprobs(client: EngineClient, probe_ids: Sequence[int]) -> list[float]:
    """The engine's log p(probe[i] | probe[:i]) for i >= 1: /generate with logprob_start_len=0 and one new token,
    read from meta_info.input_token_logprobs ([logprob, token_id, text] per input token; the first has no logprob)."""
    body = client.call("/generate", {"input_ids": list(probe_ids), "return_logprob": True, "logprob_start_len": 0,
                                     "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}})
    entries = (body.get("meta_info") or {}).get("input_token_logprobs") or []
    if len(entries) != len(probe_ids) or [int(e[1]) for e in entries] != list(probe_ids):
        raise EngineError(client.url, "/generate", f"input_token_logprobs does not cover the {len(probe_ids)}-token "
                          f"probe (got {len(entries)} entries)", retryable=False)
    return [float(e[0]) for e in entries[1:]]
