"""GLM-4.5-style MoE (HF `glm4_moe`): GQA attention with q/k/v biases and optional per-head q/k RMSNorm, RoPE on the
leading partial_rotary_factor of each head, first_k_dense_replace dense layers, then MoE layers with a shared expert
and a sigmoid router with expert bias (noaux_tc, as DeepSeek-V3). MTP layers (num_nextn_predict_layers) are not built;
their weights are skipped."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from mpo.models.config import MoEModelConfig, from_hf_common, hf_rope
from mpo.models.families import FAMILIES, Family
from mpo.models.families.common import check_group_topk, head_rules, mlp_rules, routed_moe_hf_fields, router_kwargs

log = logging.getLogger(__name__)
ARCHITECTURE = "Glm4MoeForCausalLM"


def from_hf(cfg: Mapping[str, Any]) -> MoEModelConfig:
    mtp = int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0)
    if mtp:
        log.warning("GLM-4.5: %d multi-token-prediction layer(s) are skipped (not built, their weights "
                    "model.layers.%d+ are not converted)", mtp, cfg["num_hidden_layers"])
    if not cfg.get("norm_topk_prob", True):
        raise ValueError("GLM-4.5 config.json: norm_topk_prob=false is not supported (megatron always normalises "
                         "sigmoid top-k weights)")
    dense = int(cfg.get("first_k_dense_replace", 1) or 0)
    if dense < 1:
        # With no dense layer megatron stacks the layer axis into the checkpoint keys; this family's table is
        # per-layer. No released GLM-4.5 checkpoint has one.
        raise ValueError("GLM-4.5 config.json: first_k_dense_replace=0 is not supported (set it to >= 1)")
    rope = hf_rope(cfg)
    if rope["rope_type"] != "default":
        raise ValueError(f"GLM-4.5 config.json: rope_type={rope['rope_type']!r} unsupported; valid: default")
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if int(head_dim * partial) % 2:
        raise ValueError(f"GLM-4.5 config.json: head_dim={head_dim} x partial_rotary_factor={partial} must be an even "
                         "number of rotated channels")
    experts, topk = cfg.get("n_routed_experts") or cfg["num_local_experts"], cfg["num_experts_per_tok"]
    groups = check_group_topk("GLM-4.5", topk, cfg.get("topk_group") or 1, cfg.get("n_group") or 1)
    shared = cfg.get("n_shared_experts") or 0
    return MoEModelConfig(
        architecture=ARCHITECTURE,
        **{**from_hf_common(cfg), "qk_layernorm": bool(cfg.get("use_qk_norm", False))},
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        ffn_hidden_size=cfg["intermediate_size"],
        num_experts=experts,
        norm_topk_prob=True,
        rope_theta=float(rope["rope_theta"]),
        aux_loss_coeff=0.0,
        first_k_dense=dense,
        moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"] * shared if shared else None,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_topk_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rotary_percent=partial,
        **groups,
    )


def to_hf(model: MoEModelConfig) -> dict[str, Any]:
    return {
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "attention_bias": model.attention_bias,
        "use_qk_norm": model.qk_layernorm,
        **routed_moe_hf_fields(model),
        "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default",
                            "partial_rotary_factor": model.rotary_percent},
    }


def transformer_kwargs(model: MoEModelConfig) -> dict[str, Any]:
    """The router / dense-layer arguments and q/k/v biases (partial RoPE is a GPTModel argument: the builder passes
    model.rotary_percent)."""
    return {**router_kwargs(model), "add_qkv_bias": model.attention_bias}


def mapping(cfg: MoEModelConfig, *, spec: str = "both"):
    """Per-layer keys (moe_layer_freq is a list). The local spec's keys map names both pre-MLP norms
    mlp.linear_fc1.layer_norm_weight (TE fuses a dense layer's into its fc1 too, keeps an MoE layer's module name);
    QKV weight and bias are head-group interleaved alike."""
    from mpo.models.builder import padded_vocab_size
    from mpo.models.hf_mapping import ArchInfo, ModelMapping, ParamRule

    H, L, E = cfg.hidden_size, cfg.num_layers, cfg.num_experts
    nh, ng, hd, V = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.vocab_size
    Vp = padded_vocab_size(V, 1)
    layer, d = "model.layers.{layer}.", "decoder.layers.{layer}."
    a = d + "self_attention."
    rules = [
        ParamRule("embedding.word_embeddings.weight", "model", ("model.embed_tokens.weight",), ((V, H),), (Vp, H),
                  "vocab"),
        ParamRule(a + "linear_qkv.layer_norm_weight", "layer", (layer + "input_layernorm.weight",), ((H,),), (H,)),
        ParamRule(a + "linear_qkv.weight", "layer", tuple(layer + f"self_attn.{p}_proj.weight" for p in "qkv"),
                  ((nh * hd, H), (ng * hd, H), (ng * hd, H)), ((nh + 2 * ng) * hd, H), "qkv"),
    ]
    if cfg.attention_bias:
        rules.append(ParamRule(a + "linear_qkv.bias", "layer", tuple(layer + f"self_attn.{p}_proj.bias" for p in "qkv"),
                               ((nh * hd,), (ng * hd,), (ng * hd,)), ((nh + 2 * ng) * hd,), "qkv"))
    if cfg.qk_layernorm:
        rules += [
            ParamRule(a + "q_layernorm.weight", "layer", (layer + "self_attn.q_norm.weight",), ((hd,),), (hd,)),
            ParamRule(a + "k_layernorm.weight", "layer", (layer + "self_attn.k_norm.weight",), ((hd,),), (hd,)),
        ]
    rules.append(ParamRule(a + "linear_proj.weight", "layer", (layer + "self_attn.o_proj.weight",), ((H, nh * hd),),
                           (H, nh * hd)))
    rules += mlp_rules(cfg, dense_norm=("mlp.linear_fc1.layer_norm_weight", None),
                       moe_norm=("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))
    rules += head_rules(cfg)
    mtp = tuple(f"model.layers.{i}." for i in range(L, L + 4))
    info = ArchInfo(num_layers=L, num_experts=E, vocab_size=V, padded_vocab_size=Vp, stacked=False,
                    num_query_groups=ng, heads_per_group=nh // ng, head_dim=hd, moe_layers=cfg.moe_layers,
                    skipped_hf_prefixes=mtp, skip_reason="GLM-4.5 multi-token-prediction (MTP) layers are not built "
                    "by mpo", architecture=ARCHITECTURE)
    return ModelMapping(info, rules, spec=spec)


PRESETS: dict[str, MoEModelConfig] = {
    # GLM-4.5 shape in miniature: one dense first layer, a shared expert, sigmoid router with expert bias and
    # group-limited top-k, q/k/v biases, q/k norm, RoPE on half of each head.
    "tiny-glm": MoEModelConfig(
        architecture=ARCHITECTURE, num_layers=3, num_attention_heads=4, num_query_groups=2, head_dim=16,
        ffn_hidden_size=128, moe_ffn_hidden_size=32, num_experts=8, router_topk=2, qk_layernorm=True,
        first_k_dense=1, moe_shared_expert_intermediate_size=32, router_score_function="sigmoid",
        router_enable_expert_bias=True, router_num_groups=2, router_group_topk=1, router_topk_scaling_factor=2.5,
        attention_bias=True, rotary_percent=0.5),
}

FAMILY = Family(architecture=ARCHITECTURE, model_type="glm4_moe", from_hf=from_hf, to_hf=to_hf,
                transformer_kwargs=transformer_kwargs, mapping=mapping, presets=PRESETS)
FAMILIES.register(FAMILY.architecture, FAMILY)
