"""Terms beside the policy loss: PPO's clipped value loss for the critic and VAPO's positive-example NLL (VAPO,
arXiv 2504.05118)."""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import GlobalDenominators, compute_global_denominators, token_weights
from .metrics import masked_partial_mean


def value_loss(values_new: Tensor, values_old: Tensor, returns: Tensor, mask: Tensor, *, clip: float = 0.5,
               agg: str = "token-mean", denominators: GlobalDenominators | None = None,
               group_ids: Tensor | None = None, norm_const: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """``0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2)`` aggregated with ``agg`` (verl
    ``compute_value_loss``); ``vf_clipfrac`` = fraction of tokens where the clipped term is strictly larger."""
    if clip <= 0:
        raise ValueError(f"value clip must be > 0, got {clip}")
    valid = mask.to(torch.bool)
    if denominators is None:
        denominators = compute_global_denominators(mask, group_ids)
    dtype = torch.promote_types(values_new.dtype, torch.float32)
    v = torch.where(valid, values_new.to(dtype), 0.0)
    v_old = torch.where(valid, values_old.detach().to(dtype), 0.0)
    target = torch.where(valid, returns.detach().to(dtype), 0.0)
    unclipped = (v - target) ** 2
    clipped = (v_old + torch.clamp(v - v_old, -clip, clip) - target) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    w = token_weights(mask, agg, denominators, group_ids, norm_const).to(dtype)
    metrics = {
        "vf_clipfrac": masked_partial_mean((clipped > unclipped).to(dtype), valid, denominators.num_tokens),
        "vf_value_mean": masked_partial_mean(v.detach(), valid, denominators.num_tokens),
        "vf_return_mean": masked_partial_mean(target, valid, denominators.num_tokens),
    }
    return (w * per_token).sum(), metrics


def positive_nll(logp_new: Tensor, mask: Tensor, rewards: Tensor, *, coef: float, threshold: float = 1.0,
                 num_positive_tokens: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """VAPO's positive-example LM loss: ``coef * token-mean of -logp`` over responses with reward >= threshold.

    Args:
        num_positive_tokens: the global count of valid tokens of positive responses (all micro-batches and DP
            ranks); default: this batch's own count. 0 positive tokens give a loss of 0.
    """
    positive = mask.to(torch.bool) & (rewards.to(mask.device) >= threshold)[:, None]
    if num_positive_tokens is None:
        num_positive_tokens = float(positive.sum())
    dtype = torch.promote_types(logp_new.dtype, torch.float32)
    nll = torch.where(positive, -logp_new.to(dtype), 0.0).sum()
    loss = coef * nll / num_positive_tokens if num_positive_tokens > 0 else nll * 0.0
    return loss, {"positive_nll": loss.detach()}  # a partial value: sums over micro-batches and ranks
