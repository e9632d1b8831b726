"""The engine's model: the mpo model as Hugging Face `transformers` builds it (the architecture's own modeling
code: one per family of mpo.models.families), in the engine's own process.

Why transformers and not the trainer's megatron-core GPTModel (the engine's model until issue #32): an engine is a
separate implementation of the same network, as SGLang is on a GPU cluster, and megatron-core's modules are built for
large tensor- and expert-parallel shapes (on the CPU demo its inference path generated at less than half transformers'
speed: docs/measurements.md). The trainer's forward stays megatron-core's; what the two share is the checkpoint format
(HF names, mpo.models.hf_mapping), and tests compare the engine's log-probs and routes with the trainer's forward as two
independent implementations. Meant for CPU runs and tests (an engine holds the whole model); GPU clusters use SGLang.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from mpo.models.config import MoEModelConfig

def _hf_config(cfg: MoEModelConfig):
    from transformers import AutoConfig

    from mpo.models.config import to_hf_config

    # to_hf_config names the family's transformers model_type (mpo.models.families): the engine builds that model.
    fields = {k: v for k, v in to_hf_config(cfg).items() if k not in ("architectures", "torch_dtype")}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_hf_model(cfg: MoEModelConfig, *, dtype: str, fp32_lm_head: bool, device: torch.device) -> torch.nn.Module:
    """transformers' model of `cfg` on `device` (its own random weights: load_hf replaces every one of them)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_hf_config(cfg), dtype=torch_dtype)
    if fp32_lm_head and torch_dtype != torch.float32:  # the trainer's FP32 LM head: logits from fp32 hidden states
        model.lm_head.float()
        model.lm_head.register_forward_pre_hook(lambda _module, args: tuple(a.float() for a in args))
    return model.eval()


class _RouteRecorder:
    """Each MoE layer's top-k expert indices of one forward (SGLang's routed experts), from a forward hook on the
    layer's router (`mlp.gate`, whose output is (logits, weights, indices) in both architectures)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.found: list[torch.Tensor] | None = None
        for layer in model.model.layers:  # MoE layers only (DeepSeek-V3's first dense layers have no router)
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and not isinstance(gate, torch.nn.Linear):
                gate.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output) -> None:
        if self.found is not None:
            self.found.append(output[2])

    @contextlib.contextmanager
    def session(self, want: bool) -> Iterator[list[torch.Tensor]]:
        self.found = [] if want else None
        try:
            yield self.found if want else []
        finally:
            self.found = None

    @staticmethod
    def stacked(found: list[torch.Tensor], rows: int, positions: int) -> torch.Tensor:
        """[rows, positions, MoE layers, top_k] int32 on the host (the routing hooks' layout)."""
        return torch.stack(found, 1).view(rows, positions, len(found), -1).to(torch.int32).cpu()


@dataclass
class EngineModel:
    model: torch.nn.Module  # transformers' *ForCausalLM
    model_cfg: MoEModelConfig
    routes: _RouteRecorder | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.routes is None:
            self.routes = _RouteRecorder(self.model)

    @classmethod
    def create(cls, *, preset: str, mcore_dir: str | None, seed: int, dtype: str, fp32_lm_head: bool,
               dist_port: int | None, hf_dir: str | None = None, await_weights: bool = False) -> "EngineModel":
        """The engine's model: from an HF directory (`hf_dir`: its config.json and safetensors, as SGLang loads it);
        with `await_weights`, transformers' own random init, for an engine whose weights arrive by a weight sync before
        it serves (mpo's runs publish before their first rollout); else the trainer's initial weights: megatron-core's
        model of `preset` built with `seed` (as a trainer rank builds it), or loaded from the torch_dist checkpoint
        `mcore_dir`, converted to HF names once. Only that last path imports megatron-core (~2.5 s of CPU)."""
        from mpo.models.config import from_hf_config, preset as get_preset

        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the engine is its own 1-rank world
            os.environ.pop(var, None)
        cfg = from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text())) if hf_dir else get_preset(preset)
        if hf_dir or await_weights:
            engine = cls(build_hf_model(cfg, dtype=dtype, fp32_lm_head=fp32_lm_head, device=_engine_device()), cfg)
            if hf_dir:
                from mpo.models.hf_source import HFCheckpoint

                with HFCheckpoint.open(hf_dir) as source:
                    for name, shape in engine.mapping.hf_shapes().items():  # one tensor in memory at a time
                        engine.load_hf({name: source.get(name, shape)})
            return engine
        from mpo.parallel import ParallelConfig, initialize_parallel

        ctx = initialize_parallel(ParallelConfig(), rank=0, world_size=1, master_addr="127.0.0.1",
                                  master_port=dist_port)
        engine = cls(build_hf_model(cfg, dtype=dtype, fp32_lm_head=fp32_lm_head, device=ctx.device.device), cfg)
        engine.load_hf(dict(_megatron_weights(cfg, ctx, engine.mapping, seed=seed, mcore_dir=mcore_dir,
                                              dtype=dtype, fp32_lm_head=fp32_lm_head)))
        return engine

    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    @property
    def device(self) -> torch.device:
        """Where the model computes (the GPU the engine process was given, or the CPU): inputs built on the host
        move here, results come back to the host."""
        return next(self.model.parameters()).device

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits [b, s, V] on the model's device."""
        ids = ids.to(self.device)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.model(input_ids=ids, position_ids=positions, use_cache=False).logits[..., : self.vocab_size].float()

    # -- KV-cached batch decoding (mpo.engine.generator) ---------------------------------------------------------
    def prefill(self, ids: torch.Tensor, *, capacity: int, want_routes: bool) -> tuple[Any, torch.Tensor, Any]:
        """Start a KV cache for the rows of `ids` [b, n] (host; every row has n known tokens): one causal forward
        over positions 0..n-1 (transformers' DynamicCache keeps the keys and values; it grows, so `capacity` is not
        needed). Returns (the cache, fp32 logits [b, n, V] on the model's device, routes [b, n, L, K] int32 on the
        host or None)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        logits, routes = self._cached_forward(cache, ids, want_routes)
        return cache, logits, routes

    def decode(self, cache: Any, ids: torch.Tensor, *, want_routes: bool) -> tuple[torch.Tensor, Any]:
        """One position more for every row of the cache: `ids` [b] (host) are the tokens at the cache's next
        position. Returns (fp32 logits [b, 1, V] on the model's device, routes [b, 1, L, K] int32 or None)."""
        return self._cached_forward(cache, ids[:, None], want_routes)

    def keep_rows(self, cache: Any, rows: list[int]) -> None:
        """Keep only these rows of the cache, in this order (finished rows leave the batch: no compute for them)."""
        cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.device))

    def _cached_forward(self, cache: Any, ids: torch.Tensor, want_routes: bool) -> tuple[torch.Tensor, Any]:
        ids = ids.to(self.device)
        start = cache.get_seq_length()
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand_as(ids)
        with self.routes.session(want_routes) as found:
            out = self.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        routes = _RouteRecorder.stacked(found, *ids.shape) if want_routes else None
        return out.logits[..., : self.vocab_size].float(), routes

    def score(self, sequences: list[list[int]], want_routes: bool) -> list[tuple[list[float], Any]]:
        """Log-probs of every token of each sequence (position 0 gets 0) by one uncached forward of the batch (right
        padding: causal attention keeps it out of every real position), and each position's routes (SGLang's
        routed_experts: position p < n-1)."""
        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq)
        with torch.no_grad(), self.routes.session(want_routes) as found:
            logits = self.logits(ids)
        logprobs = torch.zeros(ids.shape)
        logprobs[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None].to(logits.device)) \
            .squeeze(-1).cpu()
        routes = _RouteRecorder.stacked(found, *ids.shape) if want_routes else None
        return [(logprobs[i, : len(seq)].tolist(),
                 routes[i, : len(seq) - 1].numpy() if routes is not None else None)
                for i, seq in enumerate(sequences)]

    # -- weights -------------------------------------------------------------------------------------------------
    @functools.cached_property
    def mapping(self):
        """mpo's HF names of this model (mpo.models.hf_mapping: the checkpoint format trainer and engines share)."""
        from mpo.models.hf_mapping import mapping_for

        return mapping_for(self.model_cfg, spec="local")

    def hf_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, the view of this model's weights that holds it), every tensor of the checkpoint format."""
        return [(name, views[0]) for name, views in self._targets.items()]

    def checksum(self) -> str:
        """weights_checksum of the HF weights, read through the views load_hf writes through. A name stored in
        several places (tied embeddings) must hold one value in all of them, else the checksum cannot match."""
        from mpo.weight_sync.verify import combine_digests, tensor_digest

        return combine_digests([{
            name: tensor_digest(found[0]) if all(torch.equal(found[0], other) for other in found[1:])
            else f"copies of {name} differ"
            for name, found in self._targets.items()}])

    @functools.cached_property
    def _targets(self) -> dict[str, list[torch.Tensor]]:
        """HF name -> the views of transformers' weights it is copied into: the weight of that name, or for a
        per-expert name its expert's slice of the fused expert weights. Checked once: every name of the checkpoint
        format has a view of its shape, and the views cover every weight of the model exactly (no weight keeps
        transformers' random initialisation)."""
        from mpo.models.hf_source import ConversionError, expert_part, fused_source

        state = self.model.state_dict(keep_vars=True)  # parameters and persistent buffers (a router's bias)
        targets: dict[str, list[torch.Tensor]] = {}
        for name, shape in self.mapping.hf_shapes().items():
            # transformers keeps a MoE layer's experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]); the
            # checkpoint format has a tensor per expert: the same layout HFCheckpoint reads fused checkpoints in
            fused = fused_source(name)
            if name in state:
                view = state[name].data
            elif fused is not None and fused[0] in state:
                fused_name, expert, proj = fused
                view = expert_part(state[fused_name].data[expert], proj)
            else:
                raise ConversionError("the engine's transformers model has no weight for this tensor", tensor=name)
            if tuple(view.shape) != tuple(shape):
                raise ConversionError(f"shape {tuple(view.shape)} in the engine's model, {tuple(shape)} in the "
                                      "checkpoint format", tensor=name)
            targets.setdefault(name, []).append(view)
        covered: dict[int, int] = {}
        for views in targets.values():
            for view in views:
                key = view.untyped_storage().data_ptr()
                covered[key] = covered.get(key, 0) + view.numel()
        for name, tensor in state.items():
            key = tensor.untyped_storage().data_ptr()
            if covered.get(key, 0) < tensor.numel():
                raise ConversionError("the checkpoint format leaves part of this weight of the engine's model unset",
                                      tensor=name)
        return targets

    def load_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace weights from HF-named tensors, each copied once straight into its place in the model (dtype
        converted on copy); names not given keep their current values. A float8_e4m3fn weight comes with its
        `weight_scale_inv` among `tensors` (the block-FP8 format, mpo.weight_sync.fp8) and is dequantized on load, one
        tensor at a time: the model holds dequantize_block(weight, scale) rounded to its dtype."""
        from mpo.weight_sync.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_block, scale_name

        targets = self._targets
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name.endswith(SCALE_SUFFIX):  # read with its weight
                    continue
                if tensor.dtype == FP8_DTYPE:
                    tensor = dequantize_block(tensor, tensors[scale_name(name)])
                for view in targets[name]:
                    view.copy_(tensor.reshape(view.shape))


def _engine_device() -> torch.device:
    """The device megatron-core's 1-rank set-up would give the engine: the first visible GPU, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _megatron_weights(cfg: MoEModelConfig, ctx: Any, mapping: Any, *, seed: int, mcore_dir: str | None, dtype: str,
                      fp32_lm_head: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's initial weights under HF names: megatron-core's model of `cfg` built with `seed` exactly as a
    trainer rank builds it (or loaded from `mcore_dir`), gathered whole once at start-up (an engine holds the whole
    model anyway) and freed after."""
    from mpo.models.builder import PrecisionConfig, build_model, unwrap
    from mpo.models.full_state import gather_full_state
    from mpo.safe_load import load_sharded

    gpt = unwrap(build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype=dtype, fp32_lm_head=fp32_lm_head),
                             seed=seed))
    if mcore_dir:
        gpt.load_state_dict(load_sharded(gpt.sharded_state_dict(), mcore_dir))  # runs no code from the files
    yield from mapping.full_state_to_hf(gather_full_state(gpt))
