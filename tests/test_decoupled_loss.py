"""AReaL's decoupled PPO objective (issue #25) against a float64 reference written here from the formula (Fu et al.
2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning", eq. 5): the trust
region is taken around the proximal policy (the trainer's old-logprob forward at the current version) and each token,
sampled by a behaviour policy of whatever version, is weighted by the stop-gradient w = pi_prox / pi_behav, set to
0 above the cap (its token still counted in the denominator):

    L = agg_t [ w_t * -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) ],   r_t = pi_theta / pi_prox

decoupled_seq uses one w per row: the product of the row's token ratios. tis_token / tis_seq are the same objective
with the weight truncated at the cap, w = min(pi_prox / pi_behav, cap), instead of zeroed above it (mpo's logp_old is
always the proximal forward); tis_token is the off-policy modes' default. Value and gradient within 1e-10, with
proximal != behaviour (tokens on both sides of the cap), and the cap dropping or truncating tokens and whole rows.
"""

from __future__ import annotations

import pytest
import torch

from mpo.algorithms import CorrectionConfig, PolicyBatch, compute_policy_loss, make_loss_config

TOL = 1e-10


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 5:] = 0
    mask[4, 2:] = 0
    logp_prox = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    # behaviour: the proximal policy moved by up to +-2.5 nats, so w = exp(prox - behav) spans ~[0.08, 12]
    logp_behav = logp_prox - (torch.rand(B, T, generator=g, dtype=torch.float64) * 5 - 2.5)
    logp_new = logp_prox + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, T).clone()
    return logp_new, logp_prox, logp_behav, adv, mask


def _reference(logp_new, logp_prox, logp_behav, adv, mask, *, level, cap, eps_low, eps_high, agg, above_cap="drop"):
    valid = mask.bool()
    d = torch.where(valid, logp_prox - logp_behav, torch.zeros_like(logp_prox))
    if level == "token":
        ratio_b = torch.exp(d)
    else:
        ratio_b = torch.exp(d.sum(-1, keepdim=True)).expand_as(d)
    above = torch.zeros_like(ratio_b) if above_cap == "drop" else torch.full_like(ratio_b, cap)
    w = torch.where(ratio_b <= cap, ratio_b, above).detach()
    r = torch.exp(logp_new - logp_prox)
    objective = torch.minimum(r * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv)
    per_token = torch.where(valid, w * -objective, torch.zeros_like(r))
    if agg == "token-mean":
        return per_token.sum() / valid.sum()
    rows = valid.any(-1)
    return (per_token.sum(-1)[rows] / valid.sum(-1)[rows]).sum() / rows.sum()


@pytest.mark.parametrize("loss, agg, level, cap, kind", [("dapo", "token-mean", "token", 5.0, "decoupled"),
                                                         ("grpo", "seq-mean-token-mean", "token", 2.0, "decoupled"),
                                                         ("grpo", "seq-mean-token-mean", "seq", 5.0, "decoupled"),
                                                         ("dapo", "token-mean", "seq", 1e6, "decoupled"),
                                                         ("grpo", "seq-mean-token-mean", "token", 2.0, "tis"),
                                                         ("dapo", "token-mean", "seq", 5.0, "tis")])
def test_decoupled_loss_value_and_gradient_equal_the_formula(loss, agg, level, cap, kind):
    logp_new, logp_prox, logp_behav, adv, mask = _batch()
    assert not torch.allclose(logp_prox, logp_behav)  # proximal != behaviour
    cfg = make_loss_config(loss)
    new = logp_new.clone().requires_grad_(True)
    out = compute_policy_loss(loss, PolicyBatch(logp_new=new, logp_old=logp_prox, advantages=adv, mask=mask,
                                                group_ids=torch.arange(6), logp_rollout=logp_behav), cfg,
                              correction=CorrectionConfig(f"{kind}_{level}", cap=cap))
    out.loss.backward()
    ref_new = logp_new.clone().requires_grad_(True)
    reference = _reference(ref_new, logp_prox, logp_behav, adv, mask, level=level, cap=cap, eps_low=cfg.eps_low,
                           eps_high=cfg.eps_high, agg=agg, above_cap="drop" if kind == "decoupled" else "truncate")
    reference.backward()
    assert abs(out.loss.item() - reference.item()) <= TOL
    assert (new.grad - ref_new.grad).abs().max().item() <= TOL
    # the case is not trivial: some weights were capped to 0 (token level), some kept far from 1
    w = torch.exp(logp_prox - logp_behav)[mask.bool()]
    if level == "token":
        assert (w > cap).any() and ((w < 0.5) | ((w > 1.5) & (w <= cap))).any()
        assert (out.metrics["rollout_masked_frac"].item() > 0) == (kind == "decoupled")  # truncation drops none


def test_decoupled_equals_plain_ppo_when_behaviour_is_proximal():
    """On-policy (behaviour == proximal) every weight is 1: the decoupled loss is the plain PPO loss."""
    logp_new, logp_prox, _, adv, mask = _batch(1)
    plain = compute_policy_loss("grpo", PolicyBatch(logp_new=logp_new, logp_old=logp_prox, advantages=adv, mask=mask,
                                                    group_ids=torch.arange(6)))
    decoupled = compute_policy_loss("grpo", PolicyBatch(logp_new=logp_new, logp_old=logp_prox, advantages=adv,
                                                        mask=mask, group_ids=torch.arange(6), logp_rollout=logp_prox),
                                    correction=CorrectionConfig("decoupled_token"))
    assert abs(plain.loss.item() - decoupled.loss.item()) <= TOL


def test_off_policy_modes_default_to_the_decoupled_objective_with_replay_and_refuse_no_correction():
    import re

    from mpo.config import RECIPES
    from mpo.config import ConfigError
    from mpo.config_checks import load_config

    from mpo.config import resolve_replay

    sync = load_config(RECIPES / "demo_cpu.yaml")
    assert (sync.algorithm.rollout_correction, sync.algorithm.replay) == ("none", "none")
    for mode in ("one_step_off", "async"):
        config = load_config(RECIPES / "demo_cpu.yaml", [f"schedule.mode={mode}"])
        assert (config.algorithm.rollout_correction, config.algorithm.replay) == ("tis_token", "r3")
        assert resolve_replay(mode, router_in_front=True) == "r2"  # the router drops the engines' routes
        assert load_config(RECIPES / "demo_cpu.yaml", [f"schedule.mode={mode}", "algorithm.replay=none"]
                           ).algorithm.replay == "none"  # allowed: less stable, not incorrect
        assert load_config(RECIPES / "demo_cpu.yaml", [f"schedule.mode={mode}", "algorithm.rollout_correction=tis_seq"]
                           ).algorithm.rollout_correction == "tis_seq"
        with pytest.raises(ConfigError, match=re.escape(f"algorithm.rollout_correction='none' with schedule.mode="
                                                        f"'{mode}': the samples come from older policies")):
            load_config(RECIPES / "demo_cpu.yaml", [f"schedule.mode={mode}", "algorithm.rollout_correction=none"])
    with pytest.raises(ConfigError, match="rollout correction cap must be > 0"):
        load_config(RECIPES / "demo_cpu.yaml", ["algorithm.rollout_correction=decoupled_seq",
                                                "algorithm.rollout_correction_args={cap: 0}"])
