"""RSPO router-shift weight gamma (RSPO's router-shift term).

``gamma[i,t] = max(exp(-mean_{l,k} |log p_new^l(e_k) - log p_old^l(e_k)|), gamma_min)``, where ``e_k`` are the K
experts the *old* policy activated for the token in MoE layer l and ``p`` is the router's softmax over all experts.
gamma is a stop-gradient sample weight.

Under pipeline parallelism each stage only sees its own layers, and exponentiating per stage would be wrong. So the
computation is split: :func:`router_shift_sum` gives a per-token ``(sum |delta|, number of terms)`` over the local
layers, the caller all-reduces both (SUM) across PP stages, and :func:`gamma_from_sums` turns the totals into gamma.
Without PP, :func:`router_shift_gamma` does both steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RouterShift:
    """Per-token router-shift quantities, all detached, shape ``[B, T]``.

    Attributes:
        log_gamma: log of the (floored) weight that multiplies the importance ratio.
        gamma_raw: ``exp(-abs_logdiff)`` before the floor; ``None`` when only gamma itself was supplied.
        abs_logdiff: mean over layers and top-K of ``|log p_new - log p_old|``; ``None`` likewise.
    """

    log_gamma: Tensor
    gamma_raw: Tensor | None = None
    abs_logdiff: Tensor | None = None


def check_gamma_min(gamma_min: float) -> None:
    # 0 is allowed and means "no floor" (the golden data has such cases); the spec's recommended floor is >= e^-dl.
    if not 0.0 <= gamma_min <= 1.0:
        raise ValueError(f"gamma_min must be in [0, 1] (0 = no floor), got {gamma_min}")


def router_shift_sum(router_logp_new: Tensor, router_logp_old: Tensor,
                     layer_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token sum over local layers and top-K of ``|log p_new - log p_old|`` and the number of summed terms.

    Args:
        router_logp_new / router_logp_old: ``[B, T, L_local, K]`` router log-probs (log_softmax over all experts)
            gathered at the old top-K experts, under the current and the old router.
        layer_mask: optional ``[L_local]`` bool, False for layers to leave out (e.g. dense layers).

    Returns ``(abs_sum [B, T], count [B, T])`` in float64; both are all-reducible with SUM across PP stages.
    """
    diff = (router_logp_new.detach().to(torch.float64) - router_logp_old.detach().to(torch.float64)).abs()
    if layer_mask is not None:
        keep = layer_mask.to(device=diff.device, dtype=torch.bool)[:, None]
        diff = torch.where(keep, diff, torch.zeros_like(diff))
        n_terms = keep.sum() * diff.shape[-1]
    else:
        n_terms = diff.shape[-2] * diff.shape[-1]
    abs_sum = diff.sum(dim=(-2, -1))
    return abs_sum, torch.full_like(abs_sum, float(n_terms))


def gamma_from_sums(abs_sum: Tensor, count: Tensor, gamma_min: float) -> RouterShift:
    """gamma from the (all-reduced) per-token sums; tokens with no terms get gamma = 1."""
    check_gamma_min(gamma_min)
    abs_logdiff = torch.where(count > 0, abs_sum / torch.where(count > 0, count, torch.ones_like(count)), 0.0)
    gamma_raw = torch.exp(-abs_logdiff)
    # log(max(raw, gmin)) = max(-abs_logdiff, log gmin); written so gamma_min = 0 gives no floor without log(0).
    log_gamma = -abs_logdiff if gamma_min == 0 else torch.clamp(-abs_logdiff, min=math.log(gamma_min))
    return RouterShift(log_gamma=log_gamma, gamma_raw=gamma_raw, abs_logdiff=abs_logdiff)


def router_shift_gamma(router_logp_new: Tensor, router_logp_old: Tensor, gamma_min: float,
                       layer_mask: Tensor | None = None) -> RouterShift:
    """gamma when all MoE layers are local (no pipeline parallelism)."""
    return gamma_from_sums(*router_shift_sum(router_logp_new, router_logp_old, layer_mask), gamma_min)


def router_logp_at_old_topk(router_logits_old: Tensor, router_logits_new: Tensor,
                            topk: int) -> tuple[Tensor, Tensor, Tensor]:
    """Select the old top-K experts and gather the full-softmax router log-probs there.

    Args: router logits ``[..., L, E]`` of the old and the current router (already aligned to the scored tokens).
    Returns ``(topk_indices_old, logp_old_sel, logp_new_sel)``, each ``[..., L, K]``, experts in descending old prob.
    """
    logp_old = torch.log_softmax(router_logits_old.detach().to(torch.float64), dim=-1)
    logp_new = torch.log_softmax(router_logits_new.detach().to(torch.float64), dim=-1)
    idx = torch.topk(logp_old, topk, dim=-1, sorted=True).indices
    return idx, logp_old.gather(-1, idx), logp_new.gather(-1, idx)


def gamma_from_router_logits(router_logits_old: Tensor, router_logits_new: Tensor, topk: int,
                             gamma_min: float) -> RouterShift:
    """gamma ``[B, T]`` directly from raw router logits ``[B, T, L, E]`` (old top-K, softmax over all experts)."""
    _, old_sel, new_sel = router_logp_at_old_topk(router_logits_old, router_logits_new, topk)
    return router_shift_gamma(new_sel, old_sel, gamma_min)


def router_topk_overlap(topk_indices_old: Tensor, router_logits_new: Tensor) -> Tensor:
    """Fraction of the old top-K experts still in the current router's top-K, per token and layer ``[..., L]``.

    A diagnostic the spec asks RSPO runs to log per layer (average it over valid tokens yourself).
    """
    k = topk_indices_old.shape[-1]
    new_idx = torch.topk(router_logits_new.detach(), k, dim=-1).indices
    return (topk_indices_old[..., :, None] == new_idx[..., None, :]).any(-1).to(torch.float64).mean(-1)
