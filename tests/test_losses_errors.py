"""Clear ValueErrors for unknown names, invalid hyper-parameters and missing inputs; plus router-shift splitting."""

from __future__ import annotations

import math

import pytest
import torch

from loss_batches import make_batch, random_batch
from mpo.algorithms import (
    compute_advantages,
    compute_policy_loss,
    gamma_from_sums,
    loss_names,
    make_loss_config,
    router_shift_gamma,
    router_shift_sum,
    router_topk_overlap,
)


def test_unknown_loss_lists_known_names():
    with pytest.raises(ValueError, match="unknown loss 'ppo2'") as err:
        make_loss_config("ppo2")
    for name in loss_names():
        assert name in str(err.value)
    assert {"grpo", "dapo", "drgrpo", "cispo", "gspo", "gspo_token", "sapo", "gmpo", "rspo", "grpo+rs",
            "gspo+rs"} <= set(loss_names())


@pytest.mark.parametrize("name,param,value,pattern", [
    ("grpo", "eps_low", -0.1, r"eps_low must be >= 0"),
    ("dapo", "eps_high", -1e-3, r"eps_high must be >= 0"),
    ("gspo", "eps_low", -3e-4, r"eps_low must be >= 0"),
    ("sapo", "tau_pos", 0.0, r"tau_pos must be > 0"),
    ("sapo", "tau_neg", -1.0, r"tau_neg must be > 0"),
    ("rspo", "gamma_min", -0.1, r"gamma_min must be in \[0, 1\]"),
    ("rspo", "gamma_min", 1.5, r"gamma_min must be in \[0, 1\]"),
    ("grpo+rs", "gamma_min", 2.0, r"gamma_min must be in \[0, 1\]"),
    ("rspo", "gamma_mode", "after", r"gamma_mode must be one of pre_clip, post_clip_literal"),
    ("grpo", "agg", "mean", r"valid modes: token-mean, seq-mean-token-mean"),
    ("grpo", "dual_clip_c", 0.5, r"dual_clip_c must be None or > 1"),
    ("cispo", "is_low", 6.0, r"is_low must be None or < is_high"),
    ("grpo", "kl_estimator", "k4", r"valid: k1, k2, k3"),
    ("grpo", "clip_ratio", 0.2, r"unknown hyper-parameter\(s\) \['clip_ratio'\]"),
])
def test_invalid_hyper_parameter(name, param, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_loss_config(name, **{param: value})


def test_drgrpo_needs_norm_const():
    with pytest.raises(ValueError, match="norm_const must be > 0"):
        make_loss_config("drgrpo")


@pytest.mark.parametrize("name", ["grpo+rs", "gspo+rs", "rspo"])
def test_router_shift_loss_without_router_logp(name):
    data = random_batch(garbage=0.0)
    batch = make_batch(data, slice(0, 4), data["logp_new"][:4])
    batch.router_logp_new = batch.router_logp_old = None
    with pytest.raises(ValueError, match="needs router log-probs"):
        compute_policy_loss(name, batch)


def test_kl_coef_without_reference():
    data = random_batch(garbage=0.0)
    batch = make_batch(data, slice(0, 4), data["logp_new"][:4])
    batch.logp_ref = None
    with pytest.raises(ValueError, match="needs logp_ref"):
        compute_policy_loss("grpo", batch, make_loss_config("grpo", kl_coef=0.1))


def test_advantage_errors():
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; valid: grpo, drgrpo, rloo, batchstd"):
        compute_advantages(r, g, "ppo")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        compute_advantages(r, g, "grpo", eps=-1.0)
    with pytest.raises(ValueError, match="singleton must be one of zero, verl"):
        compute_advantages(r, g, "grpo", singleton="nan")


def test_zero_variance_groups_are_reported():
    out = compute_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5]), torch.tensor([0, 0, 1, 1, 2]))
    assert out.zero_variance.tolist() == [True, True, False, False, True]
    assert out.advantages[[0, 1, 4]].tolist() == [0.0, 0.0, 0.0]


def test_router_shift_pipeline_split_matches_single_stage():
    """Sum |delta| per PP stage, add the sums (the all-reduce), then exponentiate: equals the all-layers gamma."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 3, 4, 2, generator=g, dtype=torch.float64)
    new = old + 0.5 * torch.randn(2, 3, 4, 2, generator=g, dtype=torch.float64)
    s0, c0 = router_shift_sum(new[..., :1, :], old[..., :1, :])
    s1, c1 = router_shift_sum(new[..., 1:, :], old[..., 1:, :])
    split = gamma_from_sums(s0 + s1, c0 + c1, gamma_min=0.0)
    whole = router_shift_gamma(new, old, gamma_min=0.0)
    torch.testing.assert_close(split.log_gamma, whole.log_gamma, rtol=0, atol=1e-15)
    expected = torch.exp(-(new - old).abs().mean(dim=(-2, -1)))
    torch.testing.assert_close(whole.gamma_raw, expected, rtol=0, atol=1e-15)
    per_stage = gamma_from_sums(s0, c0, 0.0).gamma_raw * gamma_from_sums(s1, c1, 0.0).gamma_raw
    assert not torch.allclose(per_stage, whole.gamma_raw), "exponentiating per stage must differ"
    floored = router_shift_gamma(new, old, gamma_min=0.9)
    assert torch.all(floored.log_gamma >= math.log(0.9) - 1e-15)
    # A layer mask drops layers from both the sum and the count.
    masked = router_shift_gamma(new, old, 0.0, layer_mask=torch.tensor([True, False, True, True]))
    keep = [0, 2, 3]
    torch.testing.assert_close(masked.gamma_raw, torch.exp(-(new - old)[..., keep, :].abs().mean(dim=(-2, -1))),
                               rtol=0, atol=1e-15)


def test_router_topk_overlap():
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]])  # [T=1, L=2, E=4]
    old_idx = torch.topk(logits, 2, dim=-1).indices
    assert router_topk_overlap(old_idx, logits).tolist() == [[1.0, 1.0]]
    shifted = torch.tensor([[[3.0, 0.0, 2.5, 1.0], [3.0, 2.0, 1.0, 0.0]]])
    assert router_topk_overlap(old_idx, shifted).tolist() == [[0.5, 0.0]]


def test_advantage_registry_is_the_one_source_of_estimators():
    """Every estimator the config accepts is in the registry with what it needs; a registered estimator is usable by
    name without touching config or trainer code (register_advantage, as register_loss)."""
    import torch

    from mpo.algorithms import ADVANTAGE_REGISTRY, compute_advantages, register_advantage
    from mpo.algorithms.step_advantages import AdvantageConfig, StepAdvantages

    assert {n for n, s in ADVANTAGE_REGISTRY.items() if s.needs_critic} == {"gae", "vapo"}
    assert {n for n, s in ADVANTAGE_REGISTRY.items() if not s.needs_groups} == {
        "drgrpo", "reinforce_pp", "reinforce_ema", "gae", "vapo"}

    @register_advantage("test_centered", level="response", args=("eps",), needs_groups=True)
    def centered(r, g, eps, verl):
        return r - g.mean

    try:
        rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
        assert compute_advantages(rewards, groups, estimator="test_centered").advantages.tolist() == [0.5, -0.5, 0, 0]
        per_token, zero_variance = StepAdvantages(AdvantageConfig("test_centered"))(rewards, groups, [2, 1, 1, 1])
        assert per_token == [[0.5, 0.5], [-0.5], [0.0], [0.0]] and zero_variance.tolist() == [False, False, True, True]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("test_centered", level="response")(centered)
    finally:
        ADVANTAGE_REGISTRY.unregister("test_centered")
