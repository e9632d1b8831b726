"""Architecture description of an MoE language model, independent of how it is parallelised.

Built from a Hugging Face config (`from_hf_config`) or a tiny preset for tests. The builder turns it into a
megatron-core TransformerConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class MoEModelConfig:
    """A decoder-only MoE transformer (Qwen3-MoE family).

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
        qk_layernorm: RMSNorm on queries and keys per head (Qwen3).
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        tie_word_embeddings: share the input embedding with the LM head.
        max_position_embeddings: longest sequence the rotary tables are built for.
        aux_loss_coeff: load-balancing loss weight (0 is usual for RL).
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

    def with_overrides(self, **overrides: Any) -> "MoEModelConfig":
        return replace(self, **overrides)


SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def from_hf_config(hf: Mapping[str, Any] | Any) -> MoEModelConfig:
    """MoEModelConfig from a Hugging Face config (a `PretrainedConfig` or the dict of its config.json)."""
    cfg = hf if isinstance(hf, Mapping) else hf.to_dict()
    architectures = cfg.get("architectures") or [cfg.get("model_type", "?")]
    arch = architectures[0]
    if arch not in SUPPORTED_ARCHITECTURES and cfg.get("model_type") != "qwen3_moe":
        raise ValueError(f"config.json architectures={architectures}: unsupported; mpo builds "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("config.json: mlp_only_layers / decoder_sparse_step != 1 (mixed dense layers) is not supported")
    rope = cfg.get("rope_parameters") or {}
    heads = cfg["num_attention_heads"]
    return MoEModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        # transformers 5 saves num_local_experts; real Qwen3 configs say num_experts.
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        router_topk=cfg["num_experts_per_tok"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        qk_layernorm=True,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0,
    )


def to_hf_config(model: MoEModelConfig) -> dict[str, Any]:
    """The config.json dict transformers needs to build the same architecture (Qwen3-MoE)."""
    return {
        "architectures": [model.architecture],
        "model_type": "qwen3_moe",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "intermediate_size": model.ffn_hidden_size,
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.router_topk,
        "norm_topk_prob": model.norm_topk_prob,
        "rope_theta": model.rope_theta,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": model.max_position_embeddings,
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
    }


PRESETS: dict[str, MoEModelConfig] = {
    # Tests and the CPU demo: ~0.3M parameters, runs a forward in milliseconds on one core.
    "tiny": MoEModelConfig(),
    "tiny-2layer": MoEModelConfig(num_layers=2),
}


def preset(name: str) -> MoEModelConfig:
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} unknown; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
