"""What several families share: the sigmoid router's TransformerConfig arguments and the ParamRules of leading dense
layers, routed experts with an expert-biased router, and a shared expert (DeepSeek-V3 and GLM-4.5 alike), and of the
final norm and LM head (every family)."""

from __future__ import annotations

from typing import Any

from mpo.models.config import MoEModelConfig


def router_kwargs(model: MoEModelConfig) -> dict[str, Any]:
    """TransformerConfig fields for dense leading layers, a shared expert and a sigmoid / grouped / scaled router;
    each is set only when the model uses it (so a softmax-only family's config is unchanged)."""
    extra: dict[str, Any] = {}
    if model.first_k_dense:
        extra["moe_layer_freq"] = model.moe_layer_freq
    if model.moe_shared_expert_intermediate_size:
        extra["moe_shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size
    if model.router_score_function != "softmax":
        extra["moe_router_score_function"] = model.router_score_function
    if model.router_enable_expert_bias:
        # The bias is a checkpointed buffer; its online update is a training-time choice (rate 0: frozen, as in RL).
        extra.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if model.router_num_groups is not None:
        extra.update(moe_router_num_groups=model.router_num_groups, moe_router_group_topk=model.router_group_topk)
    if model.router_topk_scaling_factor is not None:
        extra["moe_router_topk_scaling_factor"] = model.router_topk_scaling_factor
    return extra


def routed_moe_hf_fields(model: MoEModelConfig) -> dict[str, Any]:
    """The config.json fields DeepSeek-V3 and GLM-4.5 share for their routed experts, shared expert, sigmoid group
    router and leading dense layers (to_hf adds each family's own)."""
    shared = model.moe_shared_expert_intermediate_size or 0
    return {
        "n_routed_experts": model.num_experts,
        "n_shared_experts": shared // model.moe_ffn_hidden_size,
        "n_group": model.router_num_groups or 1,
        "topk_group": model.router_group_topk or 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": model.router_topk_scaling_factor or 1.0,
        "first_k_dense_replace": model.first_k_dense,
        "num_nextn_predict_layers": 0,
    }

def check_group_topk(family: str, topk: int, topk_group: int, n_group: int) -> dict[str, Any]:
    """MoEModelConfig router-group fields for HF n_group / topk_group (empty when ungrouped)."""
    if n_group <= 1:
        return {}
    # megatron scores a group by the sum of its top-(topk // topk_group) experts, HF by its top-2.
    if topk % topk_group or topk // topk_group != 2:
        raise ValueError(f"{family} config.json: num_experts_per_tok={topk} / topk_group={topk_group} != 2: "
                         "megatron's group-limited routing (top-(topk/topk_group) per group) would differ from "
                         "HF's (top-2 per group)")
    return dict(router_num_groups=n_group, router_group_topk=topk_group)


def mlp_rules(cfg: MoEModelConfig, *, dense_norm: tuple[str, str | None], moe_norm: tuple[str, str | None]) -> list:
    """ParamRules of the MLP half of non-stacked layers (keys `decoder.layers.{layer}.`): the first_k_dense dense
    MLPs, then the MoE layers' router (with expert bias), routed experts and the shared expert if any.
    dense_norm / moe_norm: the (local key suffix, TE key suffix or None) of the pre-MLP RMSNorm of each kind."""
    from mpo.models.hf_mapping import ParamRule

    H, E, I, F = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.ffn_hidden_size
    dense, moe = tuple(range(cfg.first_k_dense)), cfg.moe_layers
    layer, expert = "model.layers.{layer}.", "model.layers.{layer}.mlp.experts.{expert}."
    d = "decoder.layers.{layer}."
    rules = []
    if dense:
        rules += [
            ParamRule(d + dense_norm[0], "layer", (layer + "post_attention_layernorm.weight",), ((H,),), (H,),
                      te_key=d + dense_norm[1] if dense_norm[1] else None, layers=dense),
            ParamRule(d + "mlp.linear_fc1.weight", "layer",
                      (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"), ((F, H), (F, H)), (2 * F, H),
                      "gate_up", layers=dense),
            ParamRule(d + "mlp.linear_fc2.weight", "layer", (layer + "mlp.down_proj.weight",), ((H, F),), (H, F),
                      layers=dense),
        ]
    rules += [
        ParamRule(d + moe_norm[0], "layer", (layer + "post_attention_layernorm.weight",), ((H,),), (H,),
                  te_key=d + moe_norm[1] if moe_norm[1] else None, layers=moe),
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
    return rules


def head_rules(cfg: MoEModelConfig) -> list:
    """The final norm and (untied) LM head."""
    from mpo.models.builder import padded_vocab_size
    from mpo.models.hf_mapping import ParamRule

    H, V = cfg.hidden_size, cfg.vocab_size
    rules = [ParamRule("decoder.final_layernorm.weight", "model", ("model.norm.weight",), ((H,),), (H,))]
    if not cfg.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", "model", ("lm_head.weight",), ((V, H),),
                               (padded_vocab_size(V, 1), H), "vocab"))
    return rules
