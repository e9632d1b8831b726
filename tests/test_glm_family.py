"""The GLM-4.5-style family (mpo.models.families.glm4_moe), added as one family module: a tiny random
`Glm4MoeForCausalLM` (transformers' own modeling: sigmoid router with expert bias and group-limited top-k, a shared
expert, one leading dense layer, RoPE on half of each head, q/k/v biases, q/k norm) through

  * its config both ways and the TransformerConfig it gives;
  * conversion: HF -> torch_dist -> megatron-core at TP1 / TP2 / EP2 equals transformers' logits and routes (fp32,
    <= 1e-5), and torch_dist -> HF is bit-exact and loads back into transformers;
  * mpo's engine (a real server process serving the HF directory): its rollout log-probs and routed experts equal
    transformers' forward of the same tokens;
  * one RL step of the real Trainer at EP2 from the converted checkpoint, equal to the same step at DP2.

Nothing is faked; the RL step's rollouts are fixed rows (tests/helpers/loop_layout_worker.py), as in
tests/test_loop_layouts.py, since what it checks is the trainer's step on this architecture.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from checkpoints_tools import hf_to_mcore, mcore_to_hf
from checkpoints_tools.verify import compare, default_prompts, hf_reference, run_mcore
from helpers import loop_layout_worker
from helpers.spawn import spawn_ranks
from helpers.tiny_hf import read_safetensors_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL = 1e-5
TINY_GLM = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False, initializer_range=0.1,
)


def tiny_glm(directory: Path, seed: int = 0) -> Path:
    """A tiny random Glm4MoeForCausalLM (fp32) saved by transformers. Its init zeroes the router's expert bias and
    the q/k/v biases; they get random values so their mapping is tested."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**TINY_GLM)).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(torch.randn_like(proj.bias) * 0.1)
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.1)
    model.save_pretrained(directory, max_shard_size="100KB")
    return directory


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    base = tmp_path_factory.mktemp("glm")
    hf = tiny_glm(base / "hf")
    mc = base / "mc"
    hf_to_mcore(hf, mc, show_progress=False)
    prompts = default_prompts(256)
    return {"base": base, "hf": hf, "mc": mc, "prompts": prompts, "ref": hf_reference(hf, prompts)}


def test_glm_config_both_ways(glm):
    from mpo.models.builder import transformer_config
    from mpo.models.config import from_hf_config, preset, to_hf_config
    from mpo.parallel import ParallelConfig
    from mpo.parallel.device import detect_device

    cfg = from_hf_config(json.loads((glm["hf"] / "config.json").read_text()))
    assert cfg.architecture == "Glm4MoeForCausalLM" and not cfg.multi_latent_attention
    assert (cfg.num_query_groups, cfg.head_dim, cfg.rotary_percent, cfg.attention_bias, cfg.qk_layernorm) == \
        (2, 16, 0.5, True, True)
    assert cfg.moe_layer_freq == [0, 1, 1] and cfg.moe_shared_expert_intermediate_size == 32
    assert (cfg.router_score_function, cfg.router_enable_expert_bias, cfg.router_num_groups,
            cfg.router_group_topk, cfg.router_topk_scaling_factor) == ("sigmoid", True, 2, 1, 2.5)
    assert from_hf_config(to_hf_config(cfg)) == cfg
    assert cfg == preset("tiny-glm").with_overrides(max_position_embeddings=128, norm_eps=1e-5)

    tc = transformer_config(cfg, ParallelConfig(), detect_device(0, force_cpu=True))
    assert type(tc).__name__ == "TransformerConfig" and tc.add_qkv_bias and tc.qk_layernorm
    assert tc.moe_layer_freq == [0, 1, 1] and tc.moe_router_score_function == "sigmoid"
    assert tc.moe_router_enable_expert_bias and (tc.moe_router_num_groups, tc.moe_router_group_topk) == (2, 1)
    assert tc.moe_router_topk_scaling_factor == 2.5 and tc.moe_shared_expert_intermediate_size == 32


def test_glm_unsupported_settings_are_one_line_errors():
    from mpo.models.config import from_hf_config

    base = {**TINY_GLM, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe"}
    for change, words in (({"norm_topk_prob": False}, "norm_topk_prob"),
                          ({"first_k_dense_replace": 0}, "first_k_dense_replace"),
                          ({"num_experts_per_tok": 4}, "topk_group")):
        with pytest.raises(ValueError, match=words) as info:
            from_hf_config({**base, **change})
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("layout", [dict(tp=1), dict(tp=2), dict(ep=2)], ids=["tp1", "tp2", "ep2"])
def test_glm_conversion_matches_transformers(glm, layout):
    got = run_mcore(glm["mc"], glm["prompts"], **layout)
    report = compare(glm["ref"], got, layout, tolerance=TOL)
    print("\n".join(report.lines()))
    assert report.max_logit_diff <= TOL, report.lines()
    assert report.max_logprob_diff <= TOL, report.lines()
    assert report.routing_agreement == {1: 1.0, 2: 1.0}, report.lines()  # layer 0 is dense
    assert glm["ref"]["logits"].abs().max() > 0.1


def test_glm_round_trip_is_bit_exact_and_loads_in_transformers(glm):
    from transformers import AutoModelForCausalLM

    out = glm["base"] / "hf_back"
    mcore_to_hf(glm["mc"], out, max_shard_bytes=200_000, show_progress=False)
    original, back = read_safetensors_dir(glm["hf"]), read_safetensors_dir(out)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert any(name.endswith("self_attn.k_proj.bias") for name in back)
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_glm_engine_matches_transformers(glm, tmp_path):
    """mpo's engine serving the HF directory (--model-path, as SGLang would): the log-probs and routed experts of
    its sampled rollouts equal transformers' (eager, uncached) forward of the same tokens."""
    from transformers import AutoModelForCausalLM

    from mpo.rollout.local_engine import LocalEngineProcess
    from mpo.rollout.pool import EngineHandle, RolloutPool
    from mpo.rollout.protocol import GenerateRequest, SamplingParams

    moe_layers, topk = 2, 2
    engine = LocalEngineProcess.mpo_engine(
        log_path=tmp_path / "engine.log", api_key="k", num_layers=moe_layers, topk=topk,
        extra_args=["--model-path", str(glm["hf"]), "--enable-return-routed-experts"]).start()
    try:
        requests = [GenerateRequest(tuple(glm["prompts"][i % 2][: 3 + 2 * i]),
                                    SamplingParams(max_new_tokens=8, sampling_seed=11 + i), return_routed_experts=True)
                    for i in range(3)]
        results = RolloutPool([EngineHandle(engine.client)]).generate(requests)
    finally:
        engine.stop()
    reference = AutoModelForCausalLM.from_pretrained(str(glm["hf"]), dtype=torch.float32, attn_implementation="eager",
                                                     experts_implementation="eager").eval()
    found: list[torch.Tensor] = []
    for layer in reference.model.layers[1:]:  # the MoE layers' routers: (logits, weights, top-k indices)
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: found.append(out[2]))
    worst, agree, total = 0.0, 0, 0
    for result in results:
        sequence = result.prompt_ids + result.output_ids
        found.clear()
        with torch.no_grad():
            logits = reference(torch.tensor([sequence])).logits[0].double()
        logprobs = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
        routes = torch.stack(found, 1).sort(-1).values  # [n, MoE layers, top_k]
        n_prompt, n = len(result.prompt_ids), len(sequence)
        engine_lp = torch.tensor(result.output_logprobs, dtype=torch.float64)
        worst = max(worst, (engine_lp - logprobs[n_prompt - 1:]).abs().max().item())
        assert result.routed_experts.shape == (n - 1, moe_layers, topk)
        engine_sets = torch.from_numpy(result.routed_experts).long().sort(-1).values
        agree += (engine_sets == routes[: n - 1]).all(-1).sum().item()
        total += (n - 1) * moe_layers
    print(f"\n[glm engine] max |log-prob diff| {worst:.2e}; routes agree {agree}/{total}", file=sys.stderr)
    assert worst <= TOL and agree == total > 0


def test_glm_rl_step_at_ep2_equals_dp2(glm):
    """The real Trainer's first RL step (GRPO, fixed rows) from the converted GLM checkpoint at EP2 (experts split
    over 2 ranks, tokens dispatched between them) and at DP2: the same loss, old log-probs and full gradients."""
    base = glm["base"] / "rl"
    base.mkdir()
    layouts = {"dp2": [], "ep2": ["parallel.expert_parallel=2"]}
    spawn_ranks(2, loop_layout_worker.run, str(base), str(glm["hf"]), str(glm["mc"]), layouts)
    ref, got = (torch.load(base / f"{name}.pt", weights_only=True) for name in layouts)
    assert torch.isfinite(torch.tensor(ref["loss"])) and ref["loss"] != 0.0 and ref["grad_norm"] > 0
    assert abs(got["loss"] - ref["loss"]) <= TOL
    assert got["old_logprobs"].keys() == ref["old_logprobs"].keys() and len(ref["old_logprobs"]) == 6
    for key, lp in ref["old_logprobs"].items():
        assert torch.allclose(torch.tensor(got["old_logprobs"][key]), torch.tensor(lp), atol=TOL, rtol=0), key
    assert got["grads"].keys() == ref["grads"].keys()
    assert any("expert_bias" not in k and "linear_qkv.bias" in k for k in ref["grads"])
    for key, grad in ref["grads"].items():
        assert torch.allclose(got["grads"][key], grad, atol=TOL, rtol=1e-4), key
