"""Architecture description of an MoE language model, independent of how it is parallelised.

Built from a Hugging Face config (`from_hf_config`) or a tiny preset for tests. The builder turns it into a
megatron-core TransformerConfig.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Mapping

log = logging.getLogger(__name__)


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


SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")


# config.json fields read as integers / numbers: a wrong type fails here, naming the field, not deep in arithmetic.
_HF_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                  "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "max_position_embeddings",
                  "decoder_sparse_step", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "num_nextn_predict_layers")
_HF_NUMBER_FIELDS = ("rope_theta", "rms_norm_eps", "routed_scaling_factor", "router_aux_loss_coef")


def _check_hf_field_types(cfg: Mapping[str, Any]) -> None:
    for key in _HF_INT_FIELDS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"config.json {key}={value!r}: expected an integer")
    for key in _HF_NUMBER_FIELDS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"config.json {key}={value!r}: expected a number")


def from_hf_config(hf: Mapping[str, Any] | Any) -> MoEModelConfig:
    """MoEModelConfig from a Hugging Face config (a `PretrainedConfig` or the dict of its config.json)."""
    cfg = hf if isinstance(hf, Mapping) else hf.to_dict()
    _check_hf_field_types(cfg)
    architectures = cfg.get("architectures") or [cfg.get("model_type", "?")]
    arch = architectures[0]
    if arch == "DeepseekV3ForCausalLM" or cfg.get("model_type") == "deepseek_v3":
        return _from_deepseek_v3(cfg)
    if arch not in SUPPORTED_ARCHITECTURES and cfg.get("model_type") != "qwen3_moe":
        raise ValueError(f"config.json architectures={architectures}: unsupported; mpo builds "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("config.json: mlp_only_layers / decoder_sparse_step != 1 (mixed dense layers) is not supported")
    rope = cfg.get("rope_parameters") or {}
    heads = cfg["num_attention_heads"]
    return MoEModelConfig(
        architecture="Qwen3MoeForCausalLM",
        **_from_hf_common(cfg),
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
        # transformers 5 saves num_local_experts; real Qwen3 configs say num_experts.
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0,
    )


def _from_hf_common(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The MoEModelConfig fields both architectures read alike from config.json."""
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


def _rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """HF rope settings: transformers 5 `rope_parameters`, or the legacy top-level rope_theta / rope_scaling."""
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def _from_deepseek_v3(cfg: Mapping[str, Any]) -> MoEModelConfig:
    """DeepSeek-V3: MLA, first_k_dense_replace dense layers, shared experts, sigmoid router with expert bias and
    group-limited top-k. MTP layers (num_nextn_predict_layers) are not built; their weights are skipped."""
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if mtp:
        log.warning("DeepSeek-V3: num_nextn_predict_layers=%d multi-token-prediction layer(s) are skipped (not built, "
                    "their weights model.layers.%d+ are not converted)", mtp, cfg["num_hidden_layers"])
    if cfg.get("rope_interleave", True) is not True:
        raise ValueError("DeepSeek-V3 config.json: rope_interleave=false is not supported (megatron MLA applies "
                         "interleaved RoPE)")
    if not cfg.get("norm_topk_prob", True):
        raise ValueError("DeepSeek-V3 config.json: norm_topk_prob=false is not supported (megatron always "
                         "normalises sigmoid top-k weights)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"DeepSeek-V3 config.json: topk_method={cfg.get('topk_method')!r} / scoring_func="
                         f"{cfg.get('scoring_func')!r} unsupported; valid: noaux_tc / sigmoid")
    heads = cfg["num_attention_heads"]
    experts, topk = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    n_group, topk_group = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    groups: dict[str, Any] = {}
    if n_group > 1:
        # megatron scores a group by the sum of its top-(topk // topk_group) experts, HF by its top-2.
        if topk % topk_group or topk // topk_group != 2:
            raise ValueError(f"DeepSeek-V3 config.json: num_experts_per_tok={topk} / topk_group={topk_group} != 2: "
                             "megatron's group-limited routing (top-(topk/topk_group) per group) would differ from "
                             "HF's (top-2 per group)")
        groups = dict(router_num_groups=n_group, router_group_topk=topk_group)
    rope = _rope(cfg)
    rope_type = rope["rope_type"]
    yarn: dict[str, Any] = {}
    if rope_type == "yarn":
        yarn = dict(rope_type="yarn", yarn_scaling_factor=float(rope.get("factor", 1.0)),
                    yarn_original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
                    yarn_beta_fast=float(rope.get("beta_fast", 32.0)), yarn_beta_slow=float(rope.get("beta_slow", 1.0)),
                    yarn_mscale=float(rope.get("mscale", 1.0)),
                    yarn_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
    elif rope_type != "default":
        raise ValueError(f"DeepSeek-V3 config.json: rope_type={rope_type!r} unsupported; valid: default, yarn")
    shared = cfg.get("n_shared_experts") or 0
    return MoEModelConfig(
        architecture="DeepseekV3ForCausalLM",
        **_from_hf_common(cfg),
        num_query_groups=heads,
        # config.json's head_dim is the rope dim in DeepSeek-V3: not the attention head size.
        head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_experts=experts,
        norm_topk_prob=True,
        rope_theta=float(rope["rope_theta"]),
        aux_loss_coeff=0.0,
        multi_latent_attention=True,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
        moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"] * shared if shared else None,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_topk_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        **groups,
        **yarn,
    )


def to_hf_config(model: MoEModelConfig) -> dict[str, Any]:
    """The config.json dict transformers needs to build the same architecture."""
    common = {  # the fields both architectures write alike
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
    if model.architecture == "DeepseekV3ForCausalLM":
        return {**common, **_to_deepseek_v3(model)}
    return {
        **common,
        "model_type": "qwen3_moe",
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "num_experts": model.num_experts,
        "norm_topk_prob": model.norm_topk_prob,
        "rope_theta": model.rope_theta,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _to_deepseek_v3(model: MoEModelConfig) -> dict[str, Any]:
    """DeepSeek-V3's own config.json fields (to_hf_config adds the common ones)."""
    rope: dict[str, Any] = {"rope_theta": model.rope_theta, "rope_type": "default"}
    if model.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=model.yarn_scaling_factor,
                    original_max_position_embeddings=model.yarn_original_max_position_embeddings,
                    beta_fast=model.yarn_beta_fast, beta_slow=model.yarn_beta_slow, mscale=model.yarn_mscale,
                    mscale_all_dim=model.yarn_mscale_all_dim)
    shared = model.moe_shared_expert_intermediate_size or 0
    return {
        "model_type": "deepseek_v3",
        "num_key_value_heads": model.num_attention_heads,
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "n_routed_experts": model.num_experts,
        "n_shared_experts": shared // model.moe_ffn_hidden_size,
        "n_group": model.router_num_groups or 1,
        "topk_group": model.router_group_topk or 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": model.router_topk_scaling_factor or 1.0,
        "first_k_dense_replace": model.first_k_dense,
        "num_nextn_predict_layers": 0,
        "rope_interleave": True,
        "rope_parameters": rope,
    }


PRESETS: dict[str, MoEModelConfig] = {
    # Tests and the CPU demo: ~0.3M parameters, runs a forward in milliseconds on one core.
    "tiny": MoEModelConfig(),
    "tiny-2layer": MoEModelConfig(num_layers=2),
    # DeepSeek-V3 shape in miniature (MLA, one dense first layer, shared expert, sigmoid group-limited router).
    "tiny-dsv3": MoEModelConfig(
        architecture="DeepseekV3ForCausalLM", num_layers=3, num_attention_heads=4, num_query_groups=4, head_dim=24,
        ffn_hidden_size=128, moe_ffn_hidden_size=32, num_experts=8, router_topk=2, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense=1, moe_shared_expert_intermediate_size=32, router_score_function="sigmoid",
        router_enable_expert_bias=True, router_num_groups=2, router_group_topk=1, router_topk_scaling_factor=2.5),
    # One-GPU benchmark and GPU tier (`python -m mpo.bench gpu_step`): a Qwen3-MoE shape with ~1.47B parameters,
    # ~0.34B active per token (12 layers, 32 experts of width 512, top-4, GQA 16/4 heads of 128, vocab 32768).
    "gpu_1b": MoEModelConfig(
        vocab_size=32768, hidden_size=2048, num_layers=12, num_attention_heads=16, num_query_groups=4, head_dim=128,
        ffn_hidden_size=6144, moe_ffn_hidden_size=512, num_experts=32, router_topk=4, rope_theta=1_000_000.0,
        max_position_embeddings=4096),
    # `python -m mpo.bench weight_sync --sweep`: one shape at 1 and 12 layers (the largest tensor, the 4096 x 1024
    # embedding, is the same in both), ~36M and ~341M parameters.
    # `python -m mpo.bench rollout_data`: Qwen3-30B-A3B's routing shape (48 MoE layers, 128 experts, top-8) on a
    # width so small that building it costs little; only the rollout data path is measured.
    "rollout_bench": MoEModelConfig(
        hidden_size=16, num_layers=48, num_attention_heads=2, num_query_groups=1, head_dim=8, moe_ffn_hidden_size=8,
        num_experts=128, router_topk=8, max_position_embeddings=4096),
    # `python -m mpo.bench weight_sync --shape`: many small expert tensors (8 layers x 64 experts x 3 = 1536 of
    # 8 x 16), the shape of a sync of Qwen3-30B-A3B's ~18k expert tensors at a size 2 CPU cores sync in seconds.
    # many small expert tensors (1536 of 16 x 16); moe_ffn 16, not 8: the router, kept bf16 by fp8_block, is 1/(3 x
    # moe_ffn) of a layer's expert bytes (Qwen3-30B-A3B: 1/2304), and one scale per tiny tensor weighs 2x at 8 x 16
    "sync_shape_bench": MoEModelConfig(
        hidden_size=16, num_layers=8, num_attention_heads=2, num_query_groups=1, head_dim=8, moe_ffn_hidden_size=16,
        ffn_hidden_size=32, num_experts=64, router_topk=2),
    "sync_bench_1l": MoEModelConfig(
        vocab_size=4096, hidden_size=1024, num_layers=1, num_attention_heads=8, num_query_groups=2, head_dim=128,
        ffn_hidden_size=2048, moe_ffn_hidden_size=512, num_experts=16, router_topk=2),
    "sync_bench_12l": MoEModelConfig(
        vocab_size=4096, hidden_size=1024, num_layers=12, num_attention_heads=8, num_query_groups=2, head_dim=128,
        ffn_hidden_size=2048, moe_ffn_hidden_size=512, num_experts=16, router_topk=2),
}


def preset(name: str) -> MoEModelConfig:
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} unknown; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
