"""The one Hugging Face <-> megatron-core name and layout mapping (conversion, verification and weight sync use it).

Megatron side: full, layout-free tensors keyed by megatron's torch_dist keys, exactly as
`mpo.models.full_state.gather_full_state` returns them and as a torch_dist checkpoint stores them:
  * homogeneous layer stacks (every layer MoE, `moe_layer_freq` an int): the layer index is dropped from the key and
    becomes a leading axis: `decoder.layers.self_attention.linear_qkv.weight [L, ...]`;
  * experts add an expert axis after it: `decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2I, H]`;
  * non-homogeneous stacks (some dense layers, `moe_layer_freq` a list) keep the layer index in the key:
    `decoder.layers.3.mlp.experts.experts.linear_fc1.weight [E, 2I, H]`.
Global tensors do not depend on TP/PP/EP: QKV is head-group interleaved, expert fc1 is cat(gate, up), vocabulary
tensors are padded with zero rows (megatron pads for TP; its embedding/output loaders accept any padding).

Spec: megatron's local (CPU) and Transformer Engine (GPU) layer specs name a few tensors differently (local spec
`mlp.linear_fc1.layer_norm_weight` for an MoE layer's pre-MLP norm, TE `pre_mlp_layernorm.weight`; MLA norms). A
rule has one primary key and aliases; `spec="both"` writes both names so one checkpoint loads with either spec.

A `ParamRule` describes one parameter family; `units()` expands it into per-layer / per-expert `Unit`s, each mapping
a slice of one megatron tensor to a few HF tensors. `to_mcore` / `to_hf` convert one unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Mapping

import torch

from mpo.models.hf_source import ConversionError

Scope = Literal["model", "layer", "expert"]
Kind = Literal["copy", "vocab", "qkv", "gate_up"]
Spec = Literal["local", "te", "both"]
SPECS = ("local", "te", "both")


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter family and the HF tensors it is made of.

    Attributes:
        key: torch_dist key for the local spec; for non-stacked layers a template with `{layer}`.
        te_key: the key under the Transformer Engine spec when it differs (else None).
        scope: "model" (one tensor), "layer" (one slice per layer) or "expert" (one slice per layer and expert).
        hf: HF tensor name templates (`{layer}`, `{expert}`) that make up one unit, in merge order.
        hf_shapes: the expected shape of each HF tensor.
        unit_shape: megatron shape of one unit (without the stacked layer / expert axes).
        kind: the transform: copy, vocab (zero-pad rows), qkv (head-group interleave), gate_up (cat rows).
        layers: the layers the rule applies to (None: all).
    """

    key: str
    scope: Scope
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    unit_shape: tuple[int, ...]
    kind: Kind = "copy"
    te_key: str | None = None
    layers: tuple[int, ...] | None = None

    def keys(self, spec: Spec) -> tuple[str, ...]:
        """Primary key first, then the aliases written for `spec`."""
        if self.te_key is None or spec == "local":
            return (self.key,)
        if spec == "te":
            return (self.te_key,)
        return (self.key, self.te_key)


@dataclass(frozen=True)
class Unit:
    """One slice of one megatron tensor and the HF tensors it corresponds to.

    Attributes:
        rule: the parameter family.
        keys: torch_dist keys the slice is written under (primary first).
        global_shape: full shape of the megatron tensor (with stacked axes).
        index: the unit's position on the leading stacked axes (layer and/or expert), () for unstacked tensors.
        hf_names: the concrete HF names.
    """

    rule: ParamRule
    keys: tuple[str, ...]
    global_shape: tuple[int, ...]
    index: tuple[int, ...]
    hf_names: tuple[str, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.index + (0,) * len(self.rule.unit_shape)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (1,) * len(self.index) + self.rule.unit_shape


@dataclass(frozen=True)
class ArchInfo:
    """What the mapping needs to know about the architecture, beyond its rules."""

    num_layers: int
    num_experts: int
    vocab_size: int
    padded_vocab_size: int
    stacked: bool  # homogeneous layers: layer axis stacked into the key
    num_query_groups: int = 1
    heads_per_group: int = 1
    head_dim: int = 1
    moe_layers: tuple[int, ...] = ()
    skipped_hf_prefixes: tuple[str, ...] = ()  # e.g. DeepSeek-V3 MTP layers, reported and not converted
    skip_reason: str = ""
    architecture: str = ""


class ModelMapping:
    """Rules of one architecture + the unit expansion and per-unit transforms."""

    def __init__(self, info: ArchInfo, rules: list[ParamRule], *, spec: Spec = "both") -> None:
        if spec not in SPECS:
            raise ConversionError(f"spec={spec!r}; valid: {', '.join(SPECS)}")
        self.info = info
        self.rules = rules
        self.spec = spec

    # -- expansion --------------------------------------------------------------------------------------------

    def units(self) -> Iterator[Unit]:
        info = self.info
        for rule in self.rules:
            keys = rule.keys(self.spec)
            if rule.scope == "model":
                yield Unit(rule, keys, rule.unit_shape, (), rule.hf)
                continue
            layers = rule.layers if rule.layers is not None else tuple(range(info.num_layers))
            for layer in layers:
                experts = range(info.num_experts) if rule.scope == "expert" else (None,)
                for expert in experts:
                    names = tuple(n.format(layer=layer, expert=expert) for n in rule.hf)
                    expert_axis = (info.num_experts,) if expert is not None else ()
                    expert_index = (expert,) if expert is not None else ()
                    if info.stacked:
                        yield Unit(rule, keys, (info.num_layers, *expert_axis, *rule.unit_shape),
                                   (layer, *expert_index), names)
                    else:
                        yield Unit(rule, tuple(k.format(layer=layer) for k in keys),
                                   (*expert_axis, *rule.unit_shape), expert_index, names)

    def extra_state_objects(self) -> list[str]:
        """Unique keys of the `_extra_state` ShardedObjects megatron's local spec saves (each holds None).

        megatron's loader requests them; without them a plain `dist_checkpointing.load` fails with missing keys.
        Only linear layers have them: the QKV / output projections (per layer) and the expert linears (per expert).
        """
        names = []
        for unit in self.units():
            key = unit.keys[0]
            if not key.endswith(".weight") or unit.rule.kind == "vocab":
                continue
            base = key[: -len(".weight")]
            if not _is_linear_key(base):
                continue
            shape = unit.global_shape[: len(unit.index)] or (1,)
            offset = unit.index or (0,)
            names.append(f"{base}._extra_state/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}")
        return names

    # -- transforms -------------------------------------------------------------------------------------------

    def to_mcore(self, unit: Unit, tensors: list[torch.Tensor]) -> torch.Tensor:
        """HF tensors of one unit -> the megatron slice (shape unit.rule.unit_shape)."""
        rule, info = unit.rule, self.info
        if rule.kind == "copy":
            out = tensors[0]
        elif rule.kind == "vocab":
            (weight,) = tensors
            out = torch.zeros(rule.unit_shape, dtype=weight.dtype)
            out[: weight.shape[0]] = weight
        elif rule.kind == "qkv":
            q, k, v = tensors
            hidden = q.shape[-1]
            ng, hd = info.num_query_groups, info.head_dim
            out = torch.cat([q.reshape(ng, info.heads_per_group * hd, hidden), k.reshape(ng, hd, hidden),
                             v.reshape(ng, hd, hidden)], dim=1).reshape(-1, hidden)
        elif rule.kind == "gate_up":
            out = torch.cat(tensors, dim=0)
        else:  # pragma: no cover - rules are static
            raise AssertionError(rule.kind)
        if tuple(out.shape) != rule.unit_shape:
            raise ConversionError(f"shape mismatch: built {tuple(out.shape)} for megatron {rule.unit_shape}",
                                  tensor=unit.hf_names[0])
        return out.contiguous()

    def to_hf(self, unit: Unit, tensor: torch.Tensor, *, views: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The megatron slice of one unit -> its HF (name, tensor) pairs.

        views=True: no copies. Every part is a view of `tensor` whose values, in row-major order, are the HF
        tensor's; q/k/v keep their head-group axis ((groups, rows, hidden) strided views, since the HF rows are
        not one stride apart), every other part has the HF shape. For a consumer that reads strided memory itself
        (the shared-memory weight sync: the engine copies each view into a buffer of the HF shape)."""
        rule, info = unit.rule, self.info
        if rule.kind == "copy":
            parts = [tensor]
        elif rule.kind == "vocab":
            parts = [tensor[: info.vocab_size]]
        elif rule.kind == "qkv":
            ng, hd = info.num_query_groups, info.head_dim
            grouped = tensor.reshape(ng, -1, tensor.shape[-1])
            q, k, v = torch.split(grouped, [info.heads_per_group * hd, hd, hd], dim=1)
            if views:
                return list(zip(unit.hf_names, (q, k, v)))
            parts = [x.reshape(-1, tensor.shape[-1]) for x in (q, k, v)]
        elif rule.kind == "gate_up":
            parts = list(torch.chunk(tensor, len(rule.hf), dim=0))
        else:  # pragma: no cover
            raise AssertionError(rule.kind)
        return [(name, part if views else part.contiguous()) for name, part in zip(unit.hf_names, parts)]

    # -- whole-state helpers (weight sync, tests) -------------------------------------------------------------

    def full_state_to_hf(self, full_state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Full megatron tensors (gather_full_state's output, either spec's names) -> HF (name, tensor) pairs."""
        for unit in self.units():
            tensor = _lookup(full_state, unit)
            if tensor is None:
                raise ConversionError("megatron state lacks a tensor", tensor=unit.keys[0])
            if unit.rule.kind == "vocab":
                yield from self.to_hf(unit, tensor)
            else:
                yield from self.to_hf(unit, tensor[unit.index] if unit.index else tensor)

    def hf_to_full_state(self, get: Callable[[str, tuple[int, ...]], torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF tensors (get(name, expected_shape)) -> full megatron tensors under every key of the spec."""
        full: dict[str, torch.Tensor] = {}
        for unit in self.units():
            data = self.to_mcore(unit, [get(n, s) for n, s in zip(unit.hf_names, unit.rule.hf_shapes)])
            for key in unit.keys:
                target = full.get(key)
                if target is None:
                    target = full[key] = torch.zeros(unit.global_shape, dtype=data.dtype)
                if unit.index:
                    target[unit.index] = data
                else:
                    target.copy_(data)
        return full

    def hf_names(self) -> set[str]:
        return {name for unit in self.units() for name in unit.hf_names}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> the HF tensor's shape, for every tensor of the model."""
        return {name: tuple(shape) for unit in self.units() for name, shape in zip(unit.hf_names, unit.rule.hf_shapes)}


def _lookup(full_state: Mapping[str, torch.Tensor], unit: Unit) -> torch.Tensor | None:
    for key in (*unit.keys, unit.rule.key, unit.rule.te_key):
        if key is not None and key in full_state:
            return full_state[key]
    return None


_LINEAR_SUFFIXES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
                    "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")


def _is_linear_key(base: str) -> bool:
    return base.rsplit(".", 1)[-1] in _LINEAR_SUFFIXES and not base.startswith("output_layer")


# ---------------------------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------------------------


def qwen3_moe_mapping(cfg, *, spec: Spec = "both") -> ModelMapping:
    """Qwen3-MoE: every layer MoE (stacked keys), GQA with per-head q/k RMSNorm, no biases."""
    from mpo.models.builder import padded_vocab_size

    H, L, E, I = cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.moe_ffn_hidden_size
    nh, ng, hd, V = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.vocab_size
    Vp = padded_vocab_size(V, 1)
    layer, expert = "model.layers.{layer}.", "model.layers.{layer}.mlp.experts.{expert}."
    d = "decoder.layers."
    rules = [
        ParamRule("embedding.word_embeddings.weight", "model", ("model.embed_tokens.weight",), ((V, H),), (Vp, H),
                  "vocab"),
        ParamRule(d + "self_attention.linear_qkv.layer_norm_weight", "layer", (layer + "input_layernorm.weight",),
                  ((H,),), (H,)),
        ParamRule(d + "self_attention.linear_qkv.weight", "layer",
                  tuple(layer + f"self_attn.{p}_proj.weight" for p in "qkv"),
                  ((nh * hd, H), (ng * hd, H), (ng * hd, H)), ((nh + 2 * ng) * hd, H), "qkv"),
        ParamRule(d + "self_attention.q_layernorm.weight", "layer", (layer + "self_attn.q_norm.weight",), ((hd,),),
                  (hd,)),
        ParamRule(d + "self_attention.k_layernorm.weight", "layer", (layer + "self_attn.k_norm.weight",), ((hd,),),
                  (hd,)),
        ParamRule(d + "self_attention.linear_proj.weight", "layer", (layer + "self_attn.o_proj.weight",),
                  ((H, nh * hd),), (H, nh * hd)),
        # The local spec's keys map renames pre_mlp_layernorm even for MoE layers; TE keeps the module name.
        ParamRule(d + "mlp.linear_fc1.layer_norm_weight", "layer", (layer + "post_attention_layernorm.weight",),
                  ((H,),), (H,), te_key=d + "pre_mlp_layernorm.weight"),
        ParamRule(d + "mlp.router.weight", "layer", (layer + "mlp.gate.weight",), ((E, H),), (E, H)),
        ParamRule(d + "mlp.experts.experts.linear_fc1.weight", "expert",
                  (expert + "gate_proj.weight", expert + "up_proj.weight"), ((I, H), (I, H)), (2 * I, H), "gate_up"),
        ParamRule(d + "mlp.experts.experts.linear_fc2.weight", "expert", (expert + "down_proj.weight",), ((H, I),),
                  (H, I)),
        ParamRule("decoder.final_layernorm.weight", "model", ("model.norm.weight",), ((H,),), (H,)),
    ]
    if not cfg.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", "model", ("lm_head.weight",), ((V, H),), (Vp, H), "vocab"))
    info = ArchInfo(num_layers=L, num_experts=E, vocab_size=V, padded_vocab_size=Vp, stacked=True,
                    num_query_groups=ng, heads_per_group=nh // ng, head_dim=hd, moe_layers=tuple(range(L)),
                    architecture="Qwen3MoeForCausalLM")
    return ModelMapping(info, rules, spec=spec)


def deepseek_v3_mapping(cfg, *, spec: Spec = "both") -> ModelMapping:
    """DeepSeek-V3: MLA attention, `first_k_dense` dense layers then MoE layers with a shared expert and a sigmoid
    router with expert bias. moe_layer_freq is a list, so torch_dist keys keep the layer index (not stacked).

    MLA tensors are plain copies: q_b_proj / kv_b_proj rows are per head ([nope; rope] / [nope; v]) in both, and
    kv_a_proj_with_mqa rows are [kv_lora; rope] in both; HF's rope_interleave needs no permutation (megatron's MLA
    de-interleaves). The local (CPU) MLA spec names the latent norms q_layernorm / kv_layernorm and every pre-MLP norm
    pre_mlp_layernorm; the TE spec fuses the latent norms (and a dense layer's pre-MLP norm) into the next linear.
    MTP layers (model.layers.{num_layers}+) are not built and are skipped.
    """
    from mpo.models.builder import padded_vocab_size

    H, L, E, I, F = cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.ffn_hidden_size
    nh, V = cfg.num_attention_heads, cfg.vocab_size
    nope, rope, vd, kv_lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    Vp = padded_vocab_size(V, 1)
    dense, moe = tuple(range(cfg.first_k_dense)), cfg.moe_layers
    layer, expert = "model.layers.{layer}.", "model.layers.{layer}.mlp.experts.{expert}."
    d = "decoder.layers.{layer}."
    a = d + "self_attention."
    rules = [
        ParamRule("embedding.word_embeddings.weight", "model", ("model.embed_tokens.weight",), ((V, H),), (Vp, H),
                  "vocab"),
        ParamRule(d + "input_layernorm.weight", "layer", (layer + "input_layernorm.weight",), ((H,),), (H,)),
    ]
    if cfg.q_lora_rank is None:
        rules.append(ParamRule(a + "linear_q_proj.weight", "layer", (layer + "self_attn.q_proj.weight",),
                               ((nh * (nope + rope), H),), (nh * (nope + rope), H)))
    else:
        q = cfg.q_lora_rank
        rules += [
            ParamRule(a + "linear_q_down_proj.weight", "layer", (layer + "self_attn.q_a_proj.weight",), ((q, H),),
                      (q, H)),
            ParamRule(a + "q_layernorm.weight", "layer", (layer + "self_attn.q_a_layernorm.weight",), ((q,),), (q,),
                      te_key=a + "linear_q_up_proj.layer_norm_weight"),
            ParamRule(a + "linear_q_up_proj.weight", "layer", (layer + "self_attn.q_b_proj.weight",),
                      ((nh * (nope + rope), q),), (nh * (nope + rope), q)),
        ]
    rules += [
        ParamRule(a + "linear_kv_down_proj.weight", "layer", (layer + "self_attn.kv_a_proj_with_mqa.weight",),
                  ((kv_lora + rope, H),), (kv_lora + rope, H)),
        ParamRule(a + "kv_layernorm.weight", "layer", (layer + "self_attn.kv_a_layernorm.weight",), ((kv_lora,),),
                  (kv_lora,), te_key=a + "linear_kv_up_proj.layer_norm_weight"),
        ParamRule(a + "linear_kv_up_proj.weight", "layer", (layer + "self_attn.kv_b_proj.weight",),
                  ((nh * (nope + vd), kv_lora),), (nh * (nope + vd), kv_lora)),
        ParamRule(a + "linear_proj.weight", "layer", (layer + "self_attn.o_proj.weight",), ((H, nh * vd),),
                  (H, nh * vd)),
    ]
    if dense:
        rules += [
            ParamRule(d + "pre_mlp_layernorm.weight", "layer", (layer + "post_attention_layernorm.weight",), ((H,),),
                      (H,), te_key=d + "mlp.linear_fc1.layer_norm_weight", layers=dense),
            ParamRule(d + "mlp.linear_fc1.weight", "layer",
                      (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"), ((F, H), (F, H)), (2 * F, H),
                      "gate_up", layers=dense),
            ParamRule(d + "mlp.linear_fc2.weight", "layer", (layer + "mlp.down_proj.weight",), ((H, F),), (H, F),
                      layers=dense),
        ]
    rules += [
        ParamRule(d + "pre_mlp_layernorm.weight", "layer", (layer + "post_attention_layernorm.weight",), ((H,),),
                  (H,), layers=moe),
        ParamRule(d + "mlp.router.weight", "layer", (layer + "mlp.gate.weight",), ((E, H),), (E, H), layers=moe),
        ParamRule(d + "mlp.router.expert_bias", "layer", (layer + "mlp.gate.e_score_correction_bias",), ((E,),),
                  (E,), layers=moe),
        ParamRule(d + "mlp.experts.experts.linear_fc1.weight", "expert",
                  (expert + "gate_proj.weight", expert + "up_proj.weight"), ((I, H), (I, H)), (2 * I, H), "gate_up",
                  layers=moe),
        ParamRule(d + "mlp.experts.experts.linear_fc2.weight", "expert", (expert + "down_proj.weight",), ((H, I),),
                  (H, I), layers=moe),
    ]
    if cfg.moe_shared_expert_intermediate_size:
        S = cfg.moe_shared_expert_intermediate_size
        rules += [
            ParamRule(d + "mlp.shared_experts.linear_fc1.weight", "layer",
                      (layer + "mlp.shared_experts.gate_proj.weight", layer + "mlp.shared_experts.up_proj.weight"),
                      ((S, H), (S, H)), (2 * S, H), "gate_up", layers=moe),
            ParamRule(d + "mlp.shared_experts.linear_fc2.weight", "layer",
                      (layer + "mlp.shared_experts.down_proj.weight",), ((H, S),), (H, S), layers=moe),
        ]
    rules.append(ParamRule("decoder.final_layernorm.weight", "model", ("model.norm.weight",), ((H,),), (H,)))
    if not cfg.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", "model", ("lm_head.weight",), ((V, H),), (Vp, H), "vocab"))
    mtp = tuple(f"model.layers.{i}." for i in range(L, L + 4))
    info = ArchInfo(num_layers=L, num_experts=E, vocab_size=V, padded_vocab_size=Vp, stacked=False,
                    num_query_groups=nh, heads_per_group=1, head_dim=nope + rope, moe_layers=moe,
                    skipped_hf_prefixes=mtp,
                    skip_reason="DeepSeek-V3 multi-token-prediction (MTP) layers are not built by mpo",
                    architecture="DeepseekV3ForCausalLM")
    return ModelMapping(info, rules, spec=spec)


MAPPINGS: dict[str, Callable[..., ModelMapping]] = {
    "Qwen3MoeForCausalLM": qwen3_moe_mapping,
    "DeepseekV3ForCausalLM": deepseek_v3_mapping,
}


def model_config_from_hf(hf_config: Mapping, file: str = "config.json") -> "object":
    """mpo's MoEModelConfig for an HF config.json dict; unsupported architectures and missing or mistyped fields
    raise ConversionError naming `file`."""
    from mpo.models.config import from_hf_config

    if not isinstance(hf_config, Mapping):
        raise ConversionError(f"expected a JSON object, got {type(hf_config).__name__}", file=file)
    arch = (hf_config.get("architectures") or [hf_config.get("model_type", "?")])[0]
    if arch not in MAPPINGS:
        raise ConversionError(f"unsupported architecture {arch!r}; supported: {', '.join(MAPPINGS)}", file=file)
    try:
        return from_hf_config(hf_config)
    except KeyError as exc:
        raise ConversionError(f"not convertible: missing field {exc}", file=file) from None
    except (ValueError, TypeError) as exc:
        raise ConversionError(f"not convertible: {exc}", file=file) from None


def mapping_for(model_config, *, spec: Spec = "both") -> ModelMapping:
    """The mapping of an mpo MoEModelConfig's architecture."""
    factory = MAPPINGS.get(model_config.architecture)
    if factory is None:
        raise ConversionError(f"unsupported architecture {model_config.architecture!r}; supported: "
                              f"{', '.join(MAPPINGS)}")
    return factory(model_config, spec=spec)
