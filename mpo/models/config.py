"""Architecture description of an MoE language model, independent of how it is parallelised.

Built from a Hugging Face config (`from_hf_config`) or a tiny preset for tests. The builder turns it into a
megatron-core TransformerConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class MoEModelConfig:
    """A decoder-only MoE transformer (Qwen3-MoE or DeepSeek-V3 family).

    Attributes:
        architecture: HF architecture name the weights follow, e.g. "Qwen3MoeForCausalLM".
        vocab_size: tokenizer vocabulary (unpadded; the builder pads for TP).
        hidden_size: model width.
        num_layers: transformer layers.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (GQA).
        head_dim: per-head width (megatron kv_channels).
        ffn_hidden_size: width of dense MLP layers (unused when every layer is MoE).
        moe_ffn_hidden_size: width of each expert's MLP.
        num_experts: routed experts per MoE layer.
        router_topk: experts per token.
        norm_topk_prob: renormalise the top-k softmax probabilities (megatron: moe_router_pre_softmax = not this).
        qk_layernorm: RMSNorm on queries and keys per head (Qwen3); with MLA, the RMSNorms of the q and kv latents.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        tie_word_embeddings: share the input embedding with the LM head.
        max_position_embeddings: longest sequence the rotary tables are built for.
        aux_loss_coeff: load-balancing loss weight (0 is usual for RL).

    DeepSeek-V3 family (defaults keep Qwen3-MoE behaviour):
        multi_latent_attention: MLA instead of GQA (megatron MLATransformerConfig); head_dim is then the query/key
            head width qk_nope_head_dim + qk_rope_head_dim and num_query_groups equals num_attention_heads.
        q_lora_rank: rank of the query down projection (None: a full-rank linear_q_proj).
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA widths.
        first_k_dense: the first k layers are dense MLPs (megatron moe_layer_freq=[0]*k+[1]*(L-k)).
        moe_shared_expert_intermediate_size: width of the shared expert (None: no shared expert).
        router_score_function: "softmax" (Qwen3) or "sigmoid" (DeepSeek-V3).
        router_enable_expert_bias: a per-expert bias added to scores for selection only (HF e_score_correction_bias).
        router_num_groups, router_group_topk: group-limited top-k (HF n_group / topk_group); None: off.
        router_topk_scaling_factor: multiplies the routing weights (HF routed_scaling_factor); None: 1.
        rope_type: "rope" or "yarn" (MLA only); the yarn_* fields are HF rope_parameters' yarn settings.

    GLM-4.5 family (also uses first_k_dense, the shared expert and the sigmoid router above):
        attention_bias: biases on the q, k and v projections (megatron add_qkv_bias; HF attention_bias).
        rotary_percent: the leading fraction of each head RoPE rotates (HF partial_rotary_factor).
    """

    architecture: str = "Qwen3MoeForCausalLM"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 16
    ffn_hidden_size: int = 128
    moe_ffn_hidden_size: int = 32
    num_experts: int = 8
    router_topk: int = 2
    norm_topk_prob: bool = True
    qk_layernorm: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 512
    aux_loss_coeff: float = 0.0
    # DeepSeek-V3 family.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_k_dense: int = 0
    moe_shared_expert_intermediate_size: int | None = None
    router_score_function: str = "softmax"
    router_enable_expert_bias: bool = False
    router_num_groups: int | None = None
    router_group_topk: int | None = None
    router_topk_scaling_factor: float | None = None
    rope_type: str = "rope"
    yarn_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # GLM-4.5 family (GQA with q/k/v biases and RoPE on a leading part of each head).
    attention_bias: bool = False
    rotary_percent: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "head_dim", "moe_ffn_hidden_size", "num_experts", "router_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be >= 1")
        if self.router_topk > self.num_experts:
            raise ValueError(f"model.router_topk={self.router_topk} exceeds model.num_experts={self.num_experts}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model.num_query_groups={self.num_query_groups} does not divide "
                             f"model.num_attention_heads={self.num_attention_heads}")
        if self.router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"model.router_score_function={self.router_score_function!r}; valid: softmax, sigmoid")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"model.rotary_percent={self.rotary_percent!r} must be in (0, 1]")
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"model.rope_type={self.rope_type!r}; valid: rope, yarn")
        if not 0 <= self.first_k_dense < self.num_layers:
            raise ValueError(f"model.first_k_dense={self.first_k_dense} must be in [0, num_layers={self.num_layers})")
        if self.multi_latent_attention:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"model.{name}={getattr(self, name)!r} must be >= 1 with multi_latent_attention")
        if (self.router_num_groups is None) != (self.router_group_topk is None):
            raise ValueError("model.router_num_groups and model.router_group_topk must be set together")
        if self.router_num_groups is not None and self.num_experts % self.router_num_groups:
            raise ValueError(f"model.router_num_groups={self.router_num_groups} does not divide "
                             f"model.num_experts={self.num_experts}")

    @property
    def moe_layer_freq(self) -> int | list[int]:
        """megatron moe_layer_freq: int 1 (every layer MoE, stacked checkpoint keys) or a 0/1 list per layer."""
        if self.first_k_dense == 0:
            return 1
        return [0] * self.first_k_dense + [1] * (self.num_layers - self.first_k_dense)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense, self.num_layers))

    def with_overrides(self, **overrides: Any) -> "MoEModelConfig":
        return replace(self, **overrides)


# config.json fields read as integers / numbers: a wrong type fails here, naming the field, not deep in arithmetic.
_HF_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                  "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "max_position_embeddings",
                  "decoder_sparse_step", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "num_nextn_predict_layers",
                  "num_mtp_layers")
_HF_NUMBER_FIELDS = ("rope_theta", "rms_norm_eps", "routed_scaling_factor", "router_aux_loss_coef")


def _check_hf_field_types(cfg: Mapping[str, Any]) -> None:
    for keys, types, expected in ((_HF_INT_FIELDS, int, "an integer"), (_HF_NUMBER_FIELDS, (int, float), "a number")):
        for key in keys:
            value = cfg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
                raise ValueError(f"config.json {key}={value!r}: expected {expected}")


def from_hf_config(hf: Mapping[str, Any] | Any) -> MoEModelConfig:
    """MoEModelConfig from a Hugging Face config (a `PretrainedConfig` or the dict of its config.json); the family
    (mpo.models.families) is found by `architectures[0]`, else by `model_type`."""
    from mpo.models.families import architectures, family_for_hf

    cfg = hf if isinstance(hf, Mapping) else hf.to_dict()
    _check_hf_field_types(cfg)
    family = family_for_hf(cfg)
    if family is None:
        found = cfg.get("architectures") or [cfg.get("model_type", "?")]
        raise ValueError(f"config.json architectures={found}: unsupported; mpo builds {', '.join(architectures())}")
    return family.from_hf(cfg)


def from_hf_common(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The MoEModelConfig fields every family reads alike from config.json."""
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        router_topk=cfg["num_experts_per_tok"],
        qk_layernorm=True,  # Qwen3's q / k norms; MLA's q / kv latent RMSNorms (HF q_a_layernorm, kv_a_layernorm)
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
    )


def hf_rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """HF rope settings: transformers 5 `rope_parameters`, or the legacy top-level rope_theta / rope_scaling."""
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def to_hf_config(model: MoEModelConfig) -> dict[str, Any]:
    """The config.json dict transformers needs to build the same architecture."""
    common = {  # the fields every family writes alike (a family's own fields override them)
        "architectures": [model.architecture],
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "intermediate_size": model.ffn_hidden_size,
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        "num_experts_per_tok": model.router_topk,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": model.max_position_embeddings,
        "attention_bias": False,
        "hidden_act": "silu",
    }
    from mpo.models.families import family_of

    family = family_of(model.architecture)
    return {**common, "model_type": family.model_type, **family.to_hf(model)}


class _Presets(Mapping[str, MoEModelConfig]):
    """Every family's presets (mpo.models.families), gathered on first use so importing this module imports no
    family module (they import this one)."""

    def _all(self) -> dict[str, MoEModelConfig]:
        from mpo.models.families import all_presets

        return all_presets()

    def __getitem__(self, name: str) -> MoEModelConfig:
        return self._all()[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


PRESETS: Mapping[str, MoEModelConfig] = _Presets()


def preset(name: str) -> MoEModelConfig:
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} unknown; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
