"""Weight-update endpoints of mpo's engine, with SGLang 0.5.23's session rule: updates arrive between
/begin_weight_update and /end_weight_update and take effect at the end (a unit such as QKV may span buckets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mpo.rollout.mpo_engine.server import EngineApp, RequestError
from mpo.rollout.weight_sync import MPO_FORMAT, decode_mpo_bucket


class WeightRoutes:
    def __init__(self, runner: Any, app: EngineApp) -> None:
        self.runner, self.app = runner, app
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_version: str | None = None
        self._expected: dict[str, tuple[int, ...]] = {
            name: tuple(shape) for unit in runner.mapping.units()
            for name, shape in zip(unit.hf_names, unit.rule.hf_shapes)}

    def install(self) -> None:
        self.app.add("GET", "/weights_checksum", lambda body: {"checksum": self.runner.checksum()})
        self.app.add("POST", "/update_weights_from_tensor", self.from_tensor)
        self.app.add("POST", "/update_weights_from_disk", self.from_disk)
        self.app.end_hooks.append(self.apply)

    def _stage(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if name not in self._expected:
                raise RequestError(f"weight update: unknown tensor {name!r} for this model")
            if tuple(tensor.shape) != self._expected[name]:
                raise RequestError(f"weight update: tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                                   f"expects {self._expected[name]}")
        self.pending.update(tensors)

    def from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        self.app.require_weight_update_session("update_weights_from_tensor")
        if body.get("load_format") != MPO_FORMAT:
            raise RequestError(f"mpo engine: update_weights_from_tensor takes load_format={MPO_FORMAT!r} "
                               f"(safetensors payloads), got {body.get('load_format')!r}")
        payloads = body.get("serialized_named_tensors") or []
        if len(payloads) != 1:
            raise RequestError(f"mpo engine runs at TP1: expected 1 serialized payload, got {len(payloads)}")
        self._stage(decode_mpo_bucket(payloads[0]))
        self.pending_version = body.get("weight_version") or self.pending_version
        return {"success": True, "message": "Success"}

    def from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        from checkpoints_tools.errors import ConversionError
        from checkpoints_tools.hf_source import HFCheckpoint

        path = Path(body.get("model_path") or "")
        try:
            with HFCheckpoint.open(path) as ckpt:
                tensors = {name: ckpt.get(name, shape) for name, shape in self._expected.items()}
        except (ConversionError, OSError) as exc:
            raise RequestError(f"update_weights_from_disk: {exc}") from exc
        with self.runner_lock():
            self.runner.load_hf(tensors)
        self.app.generator.weight_version = body.get("weight_version") or self.app.generator.weight_version
        return {"success": True, "message": f"Succeeded to update model weights from {path}.",
                "num_paused_requests": 0}

    def runner_lock(self):
        return self.app.generator.model_lock

    def apply(self) -> None:
        if not self.pending:
            return
        with self.runner_lock():
            self.runner.load_hf(self.pending)
        if self.pending_version:
            self.app.generator.weight_version = self.pending_version
        self.pending, self.pending_version = {}, None
