"""The model families mpo builds, registered once: one module per family, keyed by HF architecture / model_type.

A family module (e.g. `mpo.models.families.qwen3_moe`) defines `FAMILY`, a `Family`, and registers it. Everything
else (config loading, the builder, conversion, weight sync, the engine) asks this registry; adding a family is one
module listed in BUILTIN_FAMILIES. A family module may import mpo.models.config (this module imports none of its
users), but not torch at module level (mpo's light commands read configs without it): it imports the mapping inside
`mapping`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from mpo.registry import Registry

if TYPE_CHECKING:
    from mpo.models.config import MoEModelConfig
    from mpo.models.hf_mapping import ModelMapping

BUILTIN_FAMILIES = (
    "mpo.models.families.qwen3_moe",
    "mpo.models.families.deepseek_v3",
    "mpo.models.families.glm4_moe",
)


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        architecture: HF `architectures[0]`, e.g. "Qwen3MoeForCausalLM" (MoEModelConfig.architecture).
        model_type: HF `model_type`, e.g. "qwen3_moe" (what transformers' AutoConfig builds; the engine's model).
        from_hf: config.json dict -> MoEModelConfig (raises ValueError / KeyError on what it cannot build).
        to_hf: MoEModelConfig -> the family's own config.json fields (mpo.models.config.to_hf_config adds the common
            ones and model_type).
        transformer_kwargs: MoEModelConfig -> TransformerConfig arguments beyond the common ones the builder sets.
        mapping: (MoEModelConfig, spec) -> the HF <-> megatron ModelMapping (its ParamRule table).
        presets: named MoEModelConfigs of this family (tests, demos, benchmarks).
    """

    architecture: str
    model_type: str
    from_hf: Callable[[Mapping[str, Any]], "MoEModelConfig"]
    to_hf: Callable[["MoEModelConfig"], dict[str, Any]]
    transformer_kwargs: Callable[["MoEModelConfig"], dict[str, Any]]
    mapping: Callable[..., "ModelMapping"]
    presets: dict[str, "MoEModelConfig"] = field(default_factory=dict)


def _adapt_family(name: str, obj: Any) -> Family:
    if not isinstance(obj, Family):
        raise ValueError(f"model family {name!r}: {name.rpartition(':')[2]!r} is a {type(obj).__name__}, not a Family")
    return obj


FAMILIES: Registry[Family] = Registry("model family", plural="model families", builtins=BUILTIN_FAMILIES,
                                      adapt=_adapt_family)


def families() -> dict[str, Family]:
    """Every registered family by architecture, in registration (BUILTIN_FAMILIES) order."""
    return dict(FAMILIES.items(sort=False))


def architectures() -> tuple[str, ...]:
    return tuple(FAMILIES.names(sort=False))


def family_of(architecture: str) -> Family:
    """The family of an MoEModelConfig.architecture; ValueError naming the supported ones."""
    if architecture not in FAMILIES:  # an architecture is a registered name: no plug-in form here
        raise ValueError(f"architecture {architecture!r} unsupported; mpo builds {', '.join(architectures())}")
    return FAMILIES.get(architecture)


def family_for_hf(cfg: Mapping[str, Any]) -> Family | None:
    """The family of an HF config.json dict, by `architectures[0]` or else `model_type`; None if none matches."""
    arch, model_type = (cfg.get("architectures") or [None])[0], cfg.get("model_type")
    by_architecture = next((fam for fam in families().values() if arch == fam.architecture), None)
    return by_architecture or next((fam for fam in families().values() if model_type == fam.model_type), None)


def all_presets() -> dict[str, "MoEModelConfig"]:
    """Every family's presets in one dict (a name used twice is a bug in a family module)."""
    out: dict[str, "MoEModelConfig"] = {}
    for fam in families().values():
        for name, cfg in fam.presets.items():
            if name in out:
                raise ValueError(f"model preset {name!r} defined by two families")
            out[name] = cfg
    return out
