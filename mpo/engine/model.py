"""The engine's model: the same mpo GPTModel the trainer builds, at TP1 in the engine's own process."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpo.models.config import MoEModelConfig


def _load_hf_weights(gpt: torch.nn.Module, cfg: MoEModelConfig, hf_dir: str) -> None:
    """HF safetensors -> this TP1 model, through the same conversion mapping as checkpoints_tools (an engine holds
    the whole model: fine for mpo's CPU engine, which serves small models; SGLang serves the large ones)."""
    from mpo.models.full_state import load_full_state
    from mpo.models.hf_mapping import mapping_for
    from mpo.models.hf_source import HFCheckpoint

    with HFCheckpoint.open(hf_dir) as source:
        full = mapping_for(cfg, spec="local").hf_to_full_state(source.get)
    load_full_state(gpt, full)


def _whole(key: str, parts: list[tuple[tuple[int, ...], torch.Tensor, tuple[int, ...]]]) -> torch.Tensor:
    """One whole parameter from the sharded items that describe it at TP1 (megatron splits SwiGLU's fc1 into its
    gate and up halves, each a view of the one weight): the row-major tensor of the full shape over the first part's
    storage, checked to be exactly the memory of every part."""
    full_shape = parts[0][2]
    origin = next((data for offset, data, _ in parts if not any(offset)), None)
    if origin is None:
        raise RuntimeError(f"{key}: no part at offset 0 (mpo's engine runs at TP1, with whole parameters)")
    row_major = torch.empty(full_shape, device="meta").stride()
    whole = origin.as_strided(full_shape, row_major, origin.storage_offset())
    covered = 0
    for offset, data, _ in parts:
        place = whole[tuple(slice(o, o + n) for o, n in zip(offset, data.shape))]
        if place.data_ptr() != data.data_ptr() or place.stride() != data.stride() or place.shape != data.shape:
            raise RuntimeError(f"{key}: the parts at TP1 are not one row-major parameter (mpo's engine runs at TP1)")
        covered += data.numel()
    if covered != whole.numel():
        raise RuntimeError(f"{key}: the parts cover {covered} of {whole.numel()} elements")
    return whole


@dataclass
class EngineModel:
    model: torch.nn.Module
    model_cfg: MoEModelConfig
    routing: Any = None  # mpo.routing.RoutingHooks: routes of every scored token, as SGLang's routed experts

    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    @classmethod
    def create(cls, *, preset: str, mcore_dir: str | None, seed: int, dtype: str, fp32_lm_head: bool,
               dist_port: int | None, hf_dir: str | None = None) -> "EngineModel":
        """The engine's model: from an HF directory (`hf_dir`: its config.json and safetensors, as SGLang loads it),
        else `preset`, seeded, or loaded from the torch_dist checkpoint `mcore_dir`."""
        from mpo.models.builder import PrecisionConfig, build_model, unwrap
        from mpo.models.config import from_hf_config, preset as get_preset
        from mpo.parallel import ParallelConfig, initialize_parallel
        from mpo.safe_load import load_sharded

        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the engine is its own 1-rank world
            os.environ.pop(var, None)
        ctx = initialize_parallel(ParallelConfig(), rank=0, world_size=1, master_addr="127.0.0.1",
                                  master_port=dist_port)
        cfg = from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text())) if hf_dir else get_preset(preset)
        model = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype=dtype, fp32_lm_head=fp32_lm_head),
                            seed=seed)
        if hf_dir:
            _load_hf_weights(unwrap(model), cfg, hf_dir)
        elif mcore_dir:
            gpt = unwrap(model)
            gpt.load_state_dict(load_sharded(gpt.sharded_state_dict(), mcore_dir))  # runs no code from the files
        model.eval()
        from mpo.routing import attach_routing_hooks

        return cls(model, cfg, attach_routing_hooks(model))

    @property
    def device(self) -> torch.device:
        """Where the model computes (the GPU the engine process was given, or the CPU): inputs built on the host
        move here, results come back to the host."""
        return next(self.model.parameters()).device

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits [b, s, V] of the real vocabulary, on the model's device."""
        ids = ids.to(self.device)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.model(ids, positions, None)[..., : self.vocab_size].float()

    # -- KV-cached batch decoding (mpo.engine.generator) ---------------------------------------------------------
    def prefill(self, ids: torch.Tensor, *, capacity: int, want_routes: bool) -> tuple[Any, torch.Tensor, Any]:
        """Start a KV cache for the rows of `ids` [b, n] (host; every row has n known tokens): one causal forward
        over positions 0..n-1, its keys and values kept for up to `capacity` positions in megatron-core's static
        inference context (the model's own attention fills and reads it; no second model code path). Returns (the
        cache, fp32 logits [b, n, V] on the model's device, routes [b, n, L, K] int32 on the host or None)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        cache = StaticInferenceContext(ids.shape[0], capacity)
        logits, routes = self._cached_forward(cache, ids, want_routes)
        return cache, logits, routes

    def decode(self, cache: Any, ids: torch.Tensor, *, want_routes: bool) -> tuple[torch.Tensor, Any]:
        """One position more for every row of the cache: `ids` [b] (host) are the tokens at the cache's next
        position. Returns (fp32 logits [b, 1, V] on the model's device, routes [b, 1, L, K] int32 or None)."""
        return self._cached_forward(cache, ids[:, None], want_routes)

    @staticmethod
    def keep_rows(cache: Any, rows: list[int]) -> None:
        """Keep only these rows of the cache, in this order (finished rows leave the batch: no compute for them)."""
        index = torch.tensor(rows, dtype=torch.long)
        for layer, (keys, values) in cache.key_value_memory_dict.items():  # [capacity, b, ...] per layer
            cache.key_value_memory_dict[layer] = (keys[:, index.to(keys.device)], values[:, index.to(keys.device)])
        cache.max_batch_size = len(rows)

    def _cached_forward(self, cache: Any, ids: torch.Tensor, want_routes: bool) -> tuple[torch.Tensor, Any]:
        from mpo.routing.capture import CaptureConfig

        ids = ids.to(self.device)
        start = cache.sequence_len_offset  # megatron's attention writes keys/values here and attends to [0, end)
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand_as(ids)
        routes = None
        if want_routes:
            with self.routing.session(config=CaptureConfig(record=True, record_logprobs=False)) as capture:
                out = self.model(ids, positions, None, inference_context=cache)
            routes = capture.records[0].indices.to(torch.int32).cpu()
        else:
            out = self.model(ids, positions, None, inference_context=cache)
        cache.sequence_len_offset = start + ids.shape[1]  # megatron's own generation loop advances it the same way
        return out[..., : self.vocab_size].float(), routes

    def score(self, sequences: list[list[int]], want_routes: bool) -> list[tuple[list[float], Any]]:
        """Log-probs of every token of each sequence (position 0 gets 0), by the trainer's own forward path."""
        from mpo.models.forward import MicroBatch, run_microbatches

        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq)
        with self.routing.session() as capture:
            out = run_microbatches(self.model, [MicroBatch(ids.to(self.device))], vocab_size=self.vocab_size)[0]
        # Back to the host once per batch (numpy and lists need host memory; one copy, not one per row).
        logprobs = out["logprobs"].float().cpu()
        # SGLang's routed_experts: row p = routing of the token at input position p, for p < n-1, all layers.
        routes = capture.records[0].indices.to(torch.int32).cpu() if want_routes else None
        return [(logprobs[i, : len(seq)].tolist(),
                 routes[i, : len(seq) - 1].numpy() if routes is not None else None)
                for i, seq in enumerate(sequences)]

    # -- weights -------------------------------------------------------------------------------------------------
    @functools.cached_property
    def mapping(self):
        """HF <-> megatron names of this model; built once, used by every sync, checksum and disk load."""
        from mpo.models.hf_mapping import mapping_for

        return mapping_for(self.model_cfg, spec="local")

    def hf_weights(self) -> list[tuple[str, torch.Tensor]]:
        from mpo.models.builder import unwrap
        from mpo.models.full_state import gather_full_state

        return list(self.mapping.full_state_to_hf(gather_full_state(unwrap(self.model))))

    def checksum(self) -> str:
        """weights_checksum of the HF weights, read through the cached HF views of the parameters (`_targets`, the
        ones load_hf writes through): the same digests as of `hf_weights()`, without rebuilding megatron's sharded
        state dict and gathering the model at every sync (that was most of a demo sync's verification time). A
        name stored under several keys must hold one value in all of them, else the checksum cannot match."""
        from mpo.weight_sync.verify import combine_digests, tensor_digest

        views, _ = self._targets
        return combine_digests([{
            name: tensor_digest(found[0]) if all(torch.equal(found[0], other) for other in found[1:])
            else f"copies of {name} differ"
            for name, found in views.items()}])

    @functools.cached_property
    def _targets(self) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
        """(HF name -> the views of this model's parameters its values go to, the vocabulary padding rows).

        The views are the mapping's to_hf(views=True) of each unit's parameter (q/k/v: (groups, rows, hidden) views
        into the fused QKV weight). The engine runs at TP1, so every parameter is whole; a name has several views
        when a unit is stored under several keys."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        from mpo.models.hf_source import ConversionError
        from mpo.models.builder import unwrap

        sharded = unwrap(self.model).sharded_state_dict()
        apply_factories(sharded)
        parts: dict[str, dict[tuple[int, ...], list]] = {}  # key -> stacked index -> [(offset, data)]
        for item in nested_values(sharded):
            if isinstance(item, ShardedTensor):
                stacked = len(item.global_shape) - item.data.dim()
                parts.setdefault(item.key, {}).setdefault(tuple(item.global_offset[:stacked]), []).append(
                    (tuple(item.global_offset[stacked:]), item.data, tuple(item.global_shape[stacked:])))
        params = {key: {index: _whole(key, found) for index, found in by_index.items()}
                  for key, by_index in parts.items()}
        views: dict[str, list[torch.Tensor]] = {}
        padding: list[torch.Tensor] = []
        for unit in self.mapping.units():
            found = [params[key][tuple(unit.index)] for key in unit.keys if key in params]
            if not found:
                raise ConversionError("the engine's model has no parameter for this tensor", tensor=unit.keys[0])
            for data in found:
                for name, view in self.mapping.to_hf(unit, data, views=True):
                    views.setdefault(name, []).append(view)
                if unit.rule.kind == "vocab":  # rows past the vocabulary stay zero, as to_mcore pads them
                    padding.append(data[self.mapping.info.vocab_size:])
        return views, padding

    def load_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace weights from HF-named tensors, each copied once straight into its parameters (dtype converted on
        copy); names not given keep their current values. (It used to build the full megatron state first: two
        more copies of the model and fresh pages every sync, most of a sync's apply time.)"""
        views, padding = self._targets
        with torch.no_grad():
            for name, tensor in tensors.items():
                for view in views[name]:
                    view.copy_(tensor.reshape(view.shape))
            for rows in padding:
                rows.zero_()

    def add_weight_routes(self, app: Any, *, group_init_timeout_s: float = 60.0) -> None:
        """SGLang's weight-update endpoints, tensor, distributed and disk paths (mpo.engine.weight_routes)."""
        from mpo.engine.weight_routes import WeightRoutes

        WeightRoutes(self, app, group_init_timeout_s=group_init_timeout_s).install()
