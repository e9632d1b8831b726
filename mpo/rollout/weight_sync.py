"""In-place weight sync, trainer -> engines, after each optimizer step.

The trainer gathers its TP/PP/EP shards into full tensors (mpo.models.full_state), converts megatron names to Hugging
Face names with the same mapping checkpoints_tools uses, packs them into buckets of a configurable size and pushes
them inside SGLang's weight-update session (pause -> begin -> buckets -> end -> continue). Then it verifies: mpo's
engine reports a checksum of its weights that must equal the trainer's; SGLang has no such endpoint for MoE models,
so the caller compares the log-probs of a fixed probe sequence instead (verify_by_probe).

Payloads: mpo's engine takes `load_format="mpo_safetensors"` (base64 safetensors bytes: data only, never pickle).
"""

from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from mpo.rollout.client import EngineClient, EngineError

MPO_FORMAT = "mpo_safetensors"
NamedTensors = list[tuple[str, torch.Tensor]]


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

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9)

    def metrics(self) -> dict[str, float]:
        return {"sync_time_s": self.seconds, "sync_bytes": float(self.bytes), "sync_bytes_per_s": self.bytes_per_s}


class WeightSync:
    """Pushes HF-named weights to every engine over the tensor path and verifies them."""

    def __init__(self, clients: Sequence[EngineClient], *, bucket_bytes: int = 64 << 20) -> None:
        self.clients = list(clients)
        self.bucket_bytes = bucket_bytes

    def push(self, named: NamedTensors, version: str) -> SyncReport:
        started = time.perf_counter()
        buckets = make_buckets(named, self.bucket_bytes)
        for client in self.clients:
            client.pause_generation(mode="in_place")
            client.begin_weight_update()
        try:
            for bucket in buckets:
                payload = encode_mpo_bucket(bucket)
                for client in self.clients:
                    client.update_weights_from_tensor([payload], load_format=MPO_FORMAT, weight_version=version)
        finally:
            for client in self.clients:
                client.end_weight_update()
                client.continue_generation()
        total = sum(t.numel() * t.element_size() for _, t in named)
        return SyncReport(time.perf_counter() - started, total, len(buckets))

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
