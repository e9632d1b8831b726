"""SGLang's /generate wire format (sglang 0.5.23), in one place. See ../shared/spec/sglang.md section 2c.

Both engines behind the API (real SGLang and mpo's own) produce and consume exactly these shapes:
- request: {"input_ids": [...], "sampling_params": {...}, "return_logprob": true, "return_routed_experts": true}
- response meta_info.output_token_logprobs: [[logprob, token_id, null], ...], one per generated token
- response meta_info.routed_experts: base64 of little-endian int32, logical shape [prompt+completion-1, layers, top_k];
  row i is the routing of the token at input position i (the last token is never an input, so it has no row)
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """The sampling_params fields an RL rollout uses.

    Attributes:
        temperature: 0 means greedy.
        top_p: nucleus sampling mass.
        max_new_tokens: generation budget.
        stop_token_ids: generation ends after emitting any of these.
        sampling_seed: per-request seed for reproducible sampling (None: engine's own stream).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is None:
            del out["sampling_seed"]
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "SamplingParams":
        known = {k: obj[k] for k in ("temperature", "top_p", "max_new_tokens", "sampling_seed") if k in obj}
        return cls(**known, stop_token_ids=tuple(obj.get("stop_token_ids") or ()))


@dataclass(frozen=True)
class GenerateRequest:
    """One rollout request (one prompt, one sample)."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    return_logprob: bool = True
    return_routed_experts: bool = False
    rid: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": list(self.input_ids),
            "sampling_params": self.sampling.to_json(),
            "return_logprob": self.return_logprob,
        }
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        if self.rid is not None:
            body["rid"] = self.rid
        return body


@dataclass
class GenerateResult:
    """A parsed /generate response."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: str | None = None
    routed_experts: np.ndarray | None = None  # [prompt+completion-1, layers, top_k] int32
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"

    @classmethod
    def from_json(cls, request: GenerateRequest, obj: dict[str, Any], *, num_layers: int | None = None,
                  topk: int | None = None) -> "GenerateResult":
        meta = obj.get("meta_info", {})
        output_ids = list(obj.get("output_ids", []))
        triples = meta.get("output_token_logprobs") or []
        if request.return_logprob and len(triples) != len(output_ids):
            raise ValueError(f"output_token_logprobs has {len(triples)} entries for {len(output_ids)} output ids")
        routed = None
        if request.return_routed_experts:
            if num_layers is None or topk is None:
                raise ValueError("routed experts requested but the client does not know the model's num_layers and "
                                 "top_k (EngineClient(num_layers=..., topk=...))")
            if "routed_experts" not in meta:
                raise ValueError("response has no meta_info.routed_experts: was the engine started with "
                                 "--enable-return-routed-experts (and not behind a router that drops it)?")
            rows = len(request.input_ids) + len(output_ids) - 1
            routed = decode_routed_experts(meta["routed_experts"], rows=rows, num_layers=num_layers, topk=topk)
        return cls(
            prompt_ids=list(request.input_ids),
            output_ids=output_ids,
            output_logprobs=[float(t[0]) for t in triples],
            finish_reason=meta.get("finish_reason") or {},
            weight_version=meta.get("weight_version"),
            routed_experts=routed,
            meta=meta,
        )


def encode_routed_experts(experts: np.ndarray) -> str:
    """[rows, layers, top_k] integers -> SGLang's base64 little-endian int32 string."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, *, rows: int, num_layers: int, topk: int) -> np.ndarray:
    """SGLang's base64 int32 string -> [rows, layers, top_k] int32, checking the element count."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    if flat.size != rows * num_layers * topk:
        raise ValueError(f"routed_experts has {flat.size} int32 values; expected rows={rows} x layers={num_layers} "
                         f"x top_k={topk}")
    return flat.reshape(rows, num_layers, topk).copy()
