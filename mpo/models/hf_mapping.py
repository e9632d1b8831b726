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
from typing import Iterator, Literal, Mapping

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
            rest = tuple(q.shape[1:])  # (hidden,) for weights, () for biases
            ng, hd = info.num_query_groups, info.head_dim
            out = torch.cat([q.reshape(ng, info.heads_per_group * hd, *rest), k.reshape(ng, hd, *rest),
                             v.reshape(ng, hd, *rest)], dim=1).reshape(-1, *rest)
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
            rest = tuple(tensor.shape[1:])  # (hidden,) for weights, () for biases
            grouped = tensor.reshape(ng, -1, *rest)
            q, k, v = torch.split(grouped, [info.heads_per_group * hd, hd, hd], dim=1)
            if views:
                return list(zip(unit.hf_names, (q, k, v)))
            parts = [x.reshape(-1, *rest) for x in (q, k, v)]
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
            yield from self.to_hf(unit, tensor[unit.index] if unit.index else tensor)

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
# Architectures: each family's ParamRule table lives in its module (mpo.models.families); these ask the registry.
# ---------------------------------------------------------------------------------------------------------------


def model_config_from_hf(hf_config: Mapping, file: str = "config.json") -> "object":
    """mpo's MoEModelConfig for an HF config.json dict; unsupported architectures and missing or mistyped fields
    raise ConversionError naming `file`."""
    from mpo.models.config import from_hf_config
    from mpo.models.families import architectures, families

    if not isinstance(hf_config, Mapping):
        raise ConversionError(f"expected a JSON object, got {type(hf_config).__name__}", file=file)
    arch = (hf_config.get("architectures") or [hf_config.get("model_type", "?")])[0]
    if arch not in families():
        raise ConversionError(f"unsupported architecture {arch!r}; supported: {', '.join(architectures())}",
                              file=file)
    try:
        return from_hf_config(hf_config)
    except KeyError as exc:
        raise ConversionError(f"not convertible: missing field {exc}", file=file) from None
    except (ValueError, TypeError) as exc:
        raise ConversionError(f"not convertible: {exc}", file=file) from None


def mapping_for(model_config, *, spec: Spec = "both") -> ModelMapping:
    """The mapping of an mpo MoEModelConfig's architecture."""
    from mpo.models.families import architectures, families

    family = families().get(model_config.architecture)
    if family is None:
        raise ConversionError(f"unsupported architecture {model_config.architecture!r}; supported: "
                              f"{', '.join(architectures())}")
    return family.mapping(model_config, spec=spec)
