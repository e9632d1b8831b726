"""Sequence-level policy losses: GSPO, GSPO-token, GMPO and RSPO (float64 cases in tests/golden/losses.json).

A sequence loss ``ell_i`` is broadcast to the row's valid tokens, so ``L = sum_i W_i ell_i`` with
``W_i = sum_t w[i,t]``. ``A_i`` is the masked mean of the token advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batch import LossContext
from .configs import GMPOConfig, GSPOConfig, GSPORouterShiftConfig, RSPOConfig
from .metrics import stats
from .registry import register_loss
from .token_losses import clip_factor


def _seq_ratio_metrics(ctx: LossContext, seq_ratio: Tensor) -> dict[str, Tensor]:
    return stats("seq_ratio", seq_ratio.detach(), ctx.row_nonempty, ctx.denoms.num_nonempty_rows)


@register_loss("gspo", GSPOConfig)
@register_loss("gspo+rs", GSPORouterShiftConfig, router_shift=True)
def gspo_loss(ctx: LossContext, cfg: GSPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """``-min(s_i A_i, clip(s_i) A_i)`` with ``s_i = exp(mean_t (d_t + log gamma_t))``; the row is clipped as a unit."""
    adv = ctx.seq_advantages
    seq_ratio = torch.exp(ctx.row_mean_log(ctx.log_ratio + ctx.log_gamma))
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    per_seq = -adv * clip_factor(seq_ratio, adv, low, high)
    clipped = ctx.row_nonempty & (((adv > 0) & (seq_ratio > high)) | ((adv < 0) & (seq_ratio < low)))
    metrics = {
        "clipfrac_seq": ctx.row_mean(torch.ones_like(seq_ratio), clipped),
        # token-weighted, as verl logs it
        "clipfrac": ctx.token_frac(clipped[:, None].expand_as(ctx.valid)),
        **_seq_ratio_metrics(ctx, seq_ratio),
    }
    return (ctx.row_weights * per_seq).sum(), metrics


@register_loss("gspo_token", GSPOConfig)
@register_loss("gspo_token+rs", GSPORouterShiftConfig, router_shift=True)
def gspo_token_loss(ctx: LossContext, cfg: GSPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Token form: ``s_{i,t} = sg(s_i) * r_t / sg(r_t)`` (value s_i, gradient only through token t), per-token A.

    Equals GSPO when A is constant in the row; it allows per-token advantages (multi-turn).
    """
    log_seq = ctx.row_mean_log(ctx.log_ratio + ctx.log_gamma).detach()
    log_tok = ctx.log_ratio + ctx.log_gamma
    ratio = torch.exp(torch.where(ctx.valid, log_seq[:, None] + log_tok - log_tok.detach(), 0.0))
    adv = ctx.advantages
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    per_token = -adv * clip_factor(ratio, adv, low, high)
    clipped = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    return (ctx.weights * per_token).sum(), {"clipfrac": ctx.token_frac(clipped)}


def _geometric_mean_policy(ctx: LossContext, cfg: GMPOConfig, log_ratio: Tensor,
                           seq_log_bonus: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO core: one-sided token clip of the log-ratio by sign of A_i, then ``S_i = exp(mean_t x_t)``."""
    adv = ctx.seq_advantages
    adv_tok = adv[:, None]
    pos, neg = adv_tok > 0, adv_tok < 0
    clipped_log = torch.where(pos, torch.clamp(log_ratio, max=cfg.delta_high),
                              torch.clamp(log_ratio, min=-cfg.delta_low))
    clipped_log = torch.where(ctx.valid, clipped_log, 0.0)
    log_seq = ctx.row_mean_log(clipped_log)
    if seq_log_bonus is not None:
        log_seq = log_seq + seq_log_bonus
    seq_ratio = torch.exp(log_seq)
    per_seq = -adv * seq_ratio
    metrics = ctx.clip_fracs(pos & (log_ratio > cfg.delta_high), neg & (log_ratio < -cfg.delta_low))
    metrics.update(_seq_ratio_metrics(ctx, seq_ratio))
    return (ctx.row_weights * per_seq).sum(), metrics


@register_loss("gmpo", GMPOConfig)
def gmpo_loss(ctx: LossContext, cfg: GMPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """``-A_i exp(mean_t clip(d_t))``: geometric mean of token-clipped ratios (clip in log space, dl = dh = 0.4)."""
    return _geometric_mean_policy(ctx, cfg, ctx.log_ratio, None)


@register_loss("rspo", RSPOConfig, router_shift=True)
def rspo_loss(ctx: LossContext, cfg: RSPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO with the stop-gradient router-shift weight gamma.

    ``pre_clip``: the token log-ratio becomes ``d + log gamma`` before the clip (shrinks |J_i| for both signs).
    ``post_clip_literal``: clip d, then add ``sgn(A_i) * mean_t log gamma`` to ``log S_i`` (the survey formula).
    """
    if cfg.gamma_mode == "pre_clip":
        return _geometric_mean_policy(ctx, cfg, ctx.log_ratio + ctx.log_gamma, None)
    bonus = torch.sign(ctx.seq_advantages) * ctx.row_mean_log(ctx.log_gamma)
    return _geometric_mean_policy(ctx, cfg, ctx.log_ratio, bonus)
