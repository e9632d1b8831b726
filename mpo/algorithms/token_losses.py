"""Token-level policy losses: PPO clip (GRPO / DAPO / Dr.GRPO, optional router shift), SAPO, CISPO.

Each function returns ``(loss, metrics)`` with ``loss = sum_{i,t} w[i,t] * ell[i,t]`` (PPO-clip family,
CISPO, SAPO; float64 cases in tests/golden/losses.json). Inputs come from
:class:`~mpo.algorithms.batch.LossContext`, where padding is already 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import SEQ_MEAN_TOKEN_SUM_NORM, TOKEN_MEAN
from .batch import LossContext
from .configs import CISPOConfig, PPOClipConfig, PPOClipRouterShiftConfig, SAPOConfig
from .metrics import masked_partial_mean, stats
from .registry import register_loss


def clip_factor(ratio: Tensor, adv: Tensor, low: float, high: float) -> Tensor:
    """The ratio inside ``min(r A, clip(r) A)`` divided by A: ``min(r, high)`` if A>0 else ``max(r, low)``.

    Writing the PPO objective this way keeps the gradient of the unclipped side (A>0 below the lower bound, A<0 above
    the upper bound) instead of relying on how ``torch.minimum`` splits ties.
    """
    return torch.where(adv > 0, torch.clamp(ratio, max=high), torch.clamp(ratio, min=low))


@register_loss("grpo", PPOClipConfig)
@register_loss("dapo", PPOClipConfig, agg=TOKEN_MEAN, eps_low=0.2, eps_high=0.28)
@register_loss("drgrpo", PPOClipConfig, agg=SEQ_MEAN_TOKEN_SUM_NORM)
@register_loss("grpo+rs", PPOClipRouterShiftConfig, router_shift=True)
@register_loss("dapo+rs", PPOClipRouterShiftConfig, router_shift=True, agg=TOKEN_MEAN, eps_low=0.2, eps_high=0.28)
def ppo_clip_loss(ctx: LossContext, cfg: PPOClipConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` per token, with ``r = exp(d) * sg(gamma)`` for ``+rs``.

    Dual clip (``dual_clip_c``) additionally caps the A<0 factor at c, i.e. ``max(J, c A)``.
    """
    adv = ctx.advantages
    ratio = torch.exp(ctx.log_ratio + ctx.log_gamma)  # router shift enters before the clip (RSPO's plug-in form)
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    factor = clip_factor(ratio, adv, low, high)
    pos, neg = adv > 0, adv < 0
    metrics = ctx.clip_fracs(pos & (ratio > high), neg & (ratio < low))
    if cfg.dual_clip_c is not None:
        factor = torch.where(neg, torch.clamp(factor, max=cfg.dual_clip_c), factor)
        metrics["clipfrac_dual"] = ctx.token_frac(neg & (ratio > cfg.dual_clip_c))
    per_token = -adv * factor
    return (ctx.weights * per_token).sum(), metrics


@register_loss("sapo", SAPOConfig)
def sapo_loss(ctx: LossContext, cfg: SAPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """``-(4/tau) sigmoid(tau (r - 1)) A``; tau_pos for A>0, tau_neg otherwise. No clip, no stop-gradient.

    The 4/tau factor makes the on-policy gradient equal the plain policy gradient (d/dr = 4 s (1-s) = 1 at r = 1).
    """
    adv, valid = ctx.advantages, ctx.valid
    ratio = torch.exp(ctx.log_ratio)
    pos = adv > 0
    tau = torch.where(pos, ratio.new_tensor(cfg.tau_pos), ratio.new_tensor(cfg.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -(4.0 / tau) * gate * adv

    grad_weight = (4.0 * gate * (1.0 - gate)).detach()
    denoms = ctx.denoms
    if denoms.num_pos_adv_tokens is None or denoms.num_nonpos_adv_tokens is None:
        raise ValueError("sapo metrics need advantage-sign token counts: pass advantages to compute_global_denominators")
    metrics = {
        **stats("sapo_grad_weight", grad_weight, valid, denoms.num_tokens),
        "sapo_grad_weight_mean_pos": masked_partial_mean(grad_weight, valid & pos, denoms.num_pos_adv_tokens),
        # "neg" = the tokens that use tau_neg, i.e. A <= 0 (as the golden reference counts them)
        "sapo_grad_weight_mean_neg": masked_partial_mean(grad_weight, valid & ~pos, denoms.num_nonpos_adv_tokens),
        "sapo_gate_sigmoid_mean": ctx.token_mean(gate),
        "sapo_attenuated_frac": ctx.token_frac(grad_weight < 0.5),
    }
    return (ctx.weights * per_token).sum(), metrics


@register_loss("cispo", CISPOConfig)
def cispo_loss(ctx: LossContext, cfg: CISPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """``-sg(clip(r, is_low, is_high)) A logp_new``: every token keeps a gradient, scaled by the truncated IS weight.

    The loss value itself is meaningless (it contains logp_new); only its gradient matters.
    """
    adv, valid = ctx.advantages, ctx.valid
    ratio = torch.exp(ctx.log_ratio).detach()
    is_weight = torch.clamp(ratio, min=cfg.is_low, max=cfg.is_high)
    per_token = -is_weight * adv * ctx.logp_new
    above = ratio > cfg.is_high
    below = ratio < cfg.is_low if cfg.is_low is not None else torch.zeros_like(valid)
    metrics = {
        "cispo_clipfrac_high": ctx.token_frac(above),
        "cispo_clipfrac_high_posadv": ctx.token_frac(above & (adv > 0)),
        "cispo_clipfrac_low": ctx.token_frac(below),
        "cispo_is_weight_mean": ctx.token_mean(is_weight),
    }
    return (ctx.weights * per_token).sum(), metrics
