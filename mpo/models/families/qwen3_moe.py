"""Qwen3-MoE: every layer MoE, GQA with per-head q/k RMSNorm, softmax router, no biases (the demo's family)."""

from __future__ import annotations

from typing import Any, Mapping

from mpo.models.config import MoEModelConfig, from_hf_common
from mpo.models.families import FAMILIES, Family
from mpo.models.families.common import head_rules

ARCHITECTURE = "Qwen3MoeForCausalLM"


def from_hf(cfg: Mapping[str, Any]) -> MoEModelConfig:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("config.json: mlp_only_layers / decoder_sparse_step != 1 (mixed dense layers) is not supported")
    rope = cfg.get("rope_parameters") or {}
    heads = cfg["num_attention_heads"]
    return MoEModelConfig(
        architecture=ARCHITECTURE,
        **from_hf_common(cfg),
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
        # transformers 5 saves num_local_experts; real Qwen3 configs say num_experts.
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0,
    )


def to_hf(model: MoEModelConfig) -> dict[str, Any]:
    return {
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "num_experts": model.num_experts,
        "norm_topk_prob": model.norm_topk_prob,
        "rope_theta": model.rope_theta,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def transformer_kwargs(model: MoEModelConfig) -> dict[str, Any]:
    """Nothing beyond the builder's common arguments (softmax router, GQA, every layer MoE)."""
    return {}


def mapping(cfg: MoEModelConfig, *, spec: str = "both"):
    """Every layer MoE (stacked keys), GQA with per-head q/k RMSNorm, no biases."""
    from mpo.models.builder import padded_vocab_size
    from mpo.models.hf_mapping import ArchInfo, ModelMapping, ParamRule

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
        *head_rules(cfg),
    ]
    info = ArchInfo(num_layers=L, num_experts=E, vocab_size=V, padded_vocab_size=Vp, stacked=True,
                    num_query_groups=ng, heads_per_group=nh // ng, head_dim=hd, moe_layers=tuple(range(L)),
                    architecture=ARCHITECTURE)
    return ModelMapping(info, rules, spec=spec)


PRESETS: dict[str, MoEModelConfig] = {
    # Tests and the CPU demo: ~0.3M parameters, runs a forward in milliseconds on one core.
    "tiny": MoEModelConfig(),
    "tiny-2layer": MoEModelConfig(num_layers=2),
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
    # 16 x 16), the shape of a sync of Qwen3-30B-A3B's ~18k expert tensors at a size 2 CPU cores sync in seconds.
    # moe_ffn 16, not 8: the router, kept bf16 by fp8_block, is 1/(3 x moe_ffn) of a layer's expert bytes
    # (Qwen3-30B-A3B: 1/2304), and one scale per tiny tensor weighs 2x at 8 x 16
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


FAMILY = Family(architecture=ARCHITECTURE, model_type="qwen3_moe", from_hf=from_hf, to_hf=to_hf,
                transformer_kwargs=transformer_kwargs, mapping=mapping, presets=PRESETS)
FAMILIES.register(FAMILY.architecture, FAMILY)
