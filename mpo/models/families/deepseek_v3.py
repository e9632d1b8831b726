"""DeepSeek-V3: MLA attention, first_k_dense_replace dense layers, a shared expert, a sigmoid router with expert bias
and group-limited top-k. MTP layers (num_nextn_predict_layers) are not built; their weights are skipped."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from mpo.models.config import MoEModelConfig, from_hf_common, hf_rope
from mpo.models.families import FAMILIES, Family
from mpo.models.families.common import check_group_topk, head_rules, mlp_rules, routed_moe_hf_fields, router_kwargs

log = logging.getLogger(__name__)
ARCHITECTURE = "DeepseekV3ForCausalLM"


def from_hf(cfg: Mapping[str, Any]) -> MoEModelConfig:
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
    groups = check_group_topk("DeepSeek-V3", topk, cfg.get("topk_group") or 1, cfg.get("n_group") or 1)
    rope = hf_rope(cfg)
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
        architecture=ARCHITECTURE,
        **from_hf_common(cfg),
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


def to_hf(model: MoEModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": model.rope_theta, "rope_type": "default"}
    if model.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=model.yarn_scaling_factor,
                    original_max_position_embeddings=model.yarn_original_max_position_embeddings,
                    beta_fast=model.yarn_beta_fast, beta_slow=model.yarn_beta_slow, mscale=model.yarn_mscale,
                    mscale_all_dim=model.yarn_mscale_all_dim)
    return {
        "num_key_value_heads": model.num_attention_heads,
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        **routed_moe_hf_fields(model),
        "rope_interleave": True,
        "rope_parameters": rope,
    }


def transformer_kwargs(model: MoEModelConfig) -> dict[str, Any]:
    """The router / dense-layer arguments and megatron MLATransformerConfig's MLA widths and rope."""
    extra = router_kwargs(model)
    extra.update(q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank,
                 qk_head_dim=model.qk_nope_head_dim, qk_pos_emb_head_dim=model.qk_rope_head_dim,
                 v_head_dim=model.v_head_dim, rope_type=model.rope_type, rotary_base=model.rope_theta,
                 apply_rope_fusion=False)
    if model.rope_type == "yarn":
        extra.update(rotary_scaling_factor=model.yarn_scaling_factor,
                     original_max_position_embeddings=model.yarn_original_max_position_embeddings,
                     beta_fast=model.yarn_beta_fast, beta_slow=model.yarn_beta_slow, mscale=model.yarn_mscale,
                     mscale_all_dim=model.yarn_mscale_all_dim)
    return extra


def mapping(cfg: MoEModelConfig, *, spec: str = "both"):
    """MLA attention, `first_k_dense` dense layers then MoE layers with a shared expert and a sigmoid router with
    expert bias. moe_layer_freq is a list, so torch_dist keys keep the layer index (not stacked).

    MLA tensors are plain copies: q_b_proj / kv_b_proj rows are per head ([nope; rope] / [nope; v]) in both, and
    kv_a_proj_with_mqa rows are [kv_lora; rope] in both; HF's rope_interleave needs no permutation (megatron's MLA
    de-interleaves). The local (CPU) MLA spec names the latent norms q_layernorm / kv_layernorm and every pre-MLP norm
    pre_mlp_layernorm; the TE spec fuses the latent norms (and a dense layer's pre-MLP norm) into the next linear.
    MTP layers (model.layers.{num_layers}+) are not built and are skipped.
    """
    from mpo.models.builder import padded_vocab_size
    from mpo.models.hf_mapping import ArchInfo, ModelMapping, ParamRule

    H, L, E = cfg.hidden_size, cfg.num_layers, cfg.num_experts
    nh, V = cfg.num_attention_heads, cfg.vocab_size
    nope, rope, vd, kv_lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    Vp = padded_vocab_size(V, 1)
    layer, d = "model.layers.{layer}.", "decoder.layers.{layer}."
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
    rules += mlp_rules(cfg, dense_norm=("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                       moe_norm=("pre_mlp_layernorm.weight", None))
    rules += head_rules(cfg)
    mtp = tuple(f"model.layers.{i}." for i in range(L, L + 4))
    info = ArchInfo(num_layers=L, num_experts=E, vocab_size=V, padded_vocab_size=Vp, stacked=False,
                    num_query_groups=nh, heads_per_group=1, head_dim=nope + rope, moe_layers=cfg.moe_layers,
                    skipped_hf_prefixes=mtp,
                    skip_reason="DeepSeek-V3 multi-token-prediction (MTP) layers are not built by mpo",
                    architecture=ARCHITECTURE)
    return ModelMapping(info, rules, spec=spec)


PRESETS: dict[str, MoEModelConfig] = {
    # DeepSeek-V3 shape in miniature (MLA, one dense first layer, shared expert, sigmoid group-limited router).
    "tiny-dsv3": MoEModelConfig(
        architecture=ARCHITECTURE, num_layers=3, num_attention_heads=4, num_query_groups=4, head_dim=24,
        ffn_hidden_size=128, moe_ffn_hidden_size=32, num_experts=8, router_topk=2, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense=1, moe_shared_expert_intermediate_size=32, router_score_function="sigmoid",
        router_enable_expert_bias=True, router_num_groups=2, router_group_topk=1, router_topk_scaling_factor=2.5),
}

FAMILY = Family(architecture=ARCHITECTURE, model_type="deepseek_v3", from_hf=from_hf, to_hf=to_hf,
                transformer_kwargs=transformer_kwargs, mapping=mapping, presets=PRESETS)
FAMILIES.register(FAMILY.architecture, FAMILY)
