"""DPPO: a divergence trust region instead of a ratio clip (verl ``dppo_tv`` / ``dppo_kl``, arXiv 2602.04879).

``ell_t = -A_t * sg(min(r_t, C)) * logp_new_t * sg(valid_t)``: a CISPO-like truncated IS weight times a binary mask
that drops a token once the policy left the trust region around the anchor ``mu`` (the old policy, or with
``anchor="rollout"`` the engine's log-probs) in the direction its advantage pushes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import TOKEN_MEAN
from .batch import LossContext
from .configs import DPPOConfig
from .registry import register_loss

KL_EPS = 1e-8


def _binary_kl(mu: Tensor, pi: Tensor) -> Tensor:
    """KL between Bernoulli(mu) and Bernoulli(pi): the sampled token vs everything else."""
    return mu * (torch.log(mu) - torch.log(pi)) + (1 - mu) * torch.log((1 - mu + KL_EPS) / (1 - pi + KL_EPS))


def _anchor_logp(ctx: LossContext, cfg: DPPOConfig) -> Tensor:
    if cfg.anchor == "old":
        return ctx.logp_new.detach() - ctx.log_ratio.detach()
    if ctx.logp_rollout is None:
        raise ValueError("dppo with anchor='rollout' needs logp_rollout (the engine's log-probs) in the batch")
    return ctx.logp_rollout


def _dppo(ctx: LossContext, cfg: DPPOConfig, divergence: str) -> tuple[Tensor, dict[str, Tensor]]:
    adv, valid = ctx.advantages, ctx.valid
    pi = torch.exp(ctx.logp_new.detach())
    mu = torch.exp(_anchor_logp(ctx, cfg))
    pos = adv > 0
    if divergence == "tv":
        inside = torch.where(pos, pi - mu <= cfg.delta_high, pi - mu >= -cfg.delta_low)
    else:
        kl = _binary_kl(mu, pi)
        inside = torch.where(pos, (kl <= cfg.delta_high) | (pi <= mu), (kl <= cfg.delta_low) | (pi >= mu))
    inside = inside & valid
    ratio = torch.exp(ctx.log_ratio).detach()
    per_token = -adv * torch.clamp(ratio, max=cfg.is_cap) * ctx.logp_new * inside.to(ratio.dtype)
    metrics = {
        "dppo_maskfrac": ctx.token_frac(~inside),
        # among the tokens the trust region keeps (a masked token's weight does not matter)
        "dppo_truncfrac": ctx.token_frac(inside & (ratio > cfg.is_cap)),
    }
    return (ctx.weights * per_token).sum(), metrics


@register_loss("dppo_tv", DPPOConfig, agg=TOKEN_MEAN, delta_low=0.15, delta_high=0.15)
def dppo_tv_loss(ctx: LossContext, cfg: DPPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Binary total variation: a token stays while ``pi - mu <= delta_high`` (A > 0) / ``>= -delta_low`` (A <= 0)."""
    return _dppo(ctx, cfg, "tv")


@register_loss("dppo_kl", DPPOConfig, agg=TOKEN_MEAN, delta_low=0.05, delta_high=0.05)
def dppo_kl_loss(ctx: LossContext, cfg: DPPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Binary KL: a token stays while ``KL(mu || pi) <= delta`` or the policy moved against its advantage."""
    return _dppo(ctx, cfg, "kl")
