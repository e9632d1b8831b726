"""KL estimators against a reference policy (Schulman's k1/k2/k3), aggregated with the policy loss's mode.

With ``x = logp_new - logp_ref``: k1 = x, k2 = x^2/2, k3 = exp(-x) + x - 1 (the "low_var_kl" of verl).
No clamping, so the values match the golden reference; garbage at masked positions is removed before ``exp``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .aggregation import GlobalDenominators, compute_global_denominators, token_weights
from .metrics import masked_partial_mean

KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x * x,
    "k3": lambda x: torch.expm1(-x) + x,
}
# verl's names for the same estimators.
KL_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


# Estimators multiplied by the importance ratio pi_theta / pi_old (not detached, as TRL's use_bias_correction_kl and
# DeepSeek-V3.2's "unbiased KL"): samples come from the old policy, the ratio re-weights them to the current one.
RATIO_WEIGHTED: dict[str, str] = {"k3_unbiased": "k3"}


def resolve_kl_estimator(name: str) -> str:
    canonical = KL_ALIASES.get(name, name)
    if canonical not in KL_ESTIMATORS and canonical not in RATIO_WEIGHTED:
        valid = sorted([*KL_ESTIMATORS, *KL_ALIASES, *RATIO_WEIGHTED])
        raise ValueError(f"unknown kl_estimator {name!r}; valid: {', '.join(valid)}")
    return canonical


def kl_per_token(logp_new: Tensor, logp_ref: Tensor, mask: Tensor, estimator: str = "k3",
                 logp_old: Tensor | None = None) -> Tensor:
    """Per-token KL estimate, exactly 0 (value and gradient) at masked positions.

    ``k3_unbiased`` is ``k3 * exp(logp_new - logp_old)`` and needs ``logp_old``.
    """
    valid = mask.to(torch.bool)
    # bf16 log-probs are upcast: the estimator and its aggregation run in at least fp32.
    dtype = torch.promote_types(logp_new.dtype, torch.float32)
    logp_new, logp_ref = logp_new.to(dtype), logp_ref.detach().to(dtype)
    x = torch.where(valid, logp_new - logp_ref, torch.zeros_like(logp_new))
    name = resolve_kl_estimator(estimator)
    k = KL_ESTIMATORS[RATIO_WEIGHTED.get(name, name)](x)
    if name in RATIO_WEIGHTED:
        if logp_old is None:
            raise ValueError(f"kl_estimator={estimator!r} needs logp_old (it is weighted by pi_theta / pi_old)")
        log_ratio = torch.where(valid, logp_new - logp_old.detach().to(dtype), torch.zeros_like(logp_new))
        k = k * torch.exp(log_ratio)
    return torch.where(valid, k, torch.zeros_like(x))


def kl_penalty(logp_new: Tensor, logp_ref: Tensor, mask: Tensor, estimator: str = "k3", agg: str = "token-mean",
               denominators: GlobalDenominators | None = None, group_ids: Tensor | None = None,
               norm_const: float | None = None, logp_old: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """``agg(k)`` over this micro-batch with global denominators, and ``{"kl_mean": token mean of k}``.

    Multiply by the KL coefficient yourself, or set ``kl_coef`` in the loss config to have it added to the loss.
    """
    if denominators is None:
        denominators = compute_global_denominators(mask, group_ids)
    k = kl_per_token(logp_new, logp_ref, mask, estimator, logp_old)
    w = token_weights(mask, agg, denominators, group_ids, norm_const).to(k.dtype)
    kl_mean = masked_partial_mean(k.detach(), mask.to(torch.bool), denominators.num_tokens)
    return (w * k).sum(), {"kl_mean": kl_mean}
