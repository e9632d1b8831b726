"""Rollout correction: importance weights and masks for the mismatch between the engine's log-probs and the
trainer's old log-probs (TIS, IcePop, MIS; the float64 cases in tests/golden/algorithms_v2.json).

With ``d = logp_old - logp_rollout`` per valid token, a correction gives stop-gradient weights ``w[i,t]`` and a mask
``mask_out``; any loss then uses ``L = sum agg_w(mask_out)[i,t] * w[i,t] * ell[i,t]`` with aggregation denominators over
the kept tokens (``compute_policy_loss`` does this when given a :class:`CorrectionConfig`). Sequence losses weight a row
by ``sum_t agg_w * w``. The mismatch metrics are computed whenever engine log-probs exist, also with the correction off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from mpo.parallel.collectives import all_reduce_

from .metrics import masked_partial_mean, stats

# Per kind: which bounds it uses and their defaults (slime TIS C=2; verl IcePop "0.5_5.0"; verl decoupled seq IS-RS;
# AReaL's decoupled PPO: behaviour weights above the cap are dropped, its configs' behav_imp_weight_cap is 5).
CORRECTION_DEFAULTS: dict[str, dict[str, float]] = {
    "none": {},
    "tis_token": {"cap": 2.0},
    "tis_seq": {"cap": 2.0},
    "icepop_token": {"lower": 0.5, "upper": 5.0},
    "mis_seq": {"cap": 2.0, "lower": 0.5, "upper": 2.0},
    "decoupled_token": {"cap": 5.0},
    "decoupled_seq": {"cap": 5.0},
}
# The off-policy schedules' default (schedule.mode one_step_off / async with rollout_correction unset): the decoupled
# objective with a truncated behaviour weight. mpo's logp_old is always the proximal policy (the trainer's forward at
# the current version), so tis_token is L = min(pi_prox / pi_behav, 2) * PPO-clip(pi_theta / pi_prox): AReaL's
# objective, its weight truncated at the cap instead of zeroed above it. Zeroing (decoupled_token / decoupled_seq)
# removes exactly the tokens whose probability rose most since they were sampled; late in a run those are the few
# wrong answers a bad update made likelier, so the gradient that would undo the update is dropped and the run
# collapses (measured: docs/measurements.md). tis_token alone is not enough either: the off-policy modes also replay
# routes (algorithm.replay unset -> r3).
OFF_POLICY_DEFAULT = "tis_token"


@dataclass(frozen=True)
class CorrectionConfig:
    """Which correction and its bounds; a bound left None takes the kind's default.

    Attributes:
        kind: ``none``, ``tis_token`` / ``tis_seq`` (truncated IS, cap C), ``icepop_token`` (token weight exp(d) inside
            [lower, upper], else 0), ``mis_seq`` (rows whose sequence ratio is outside [lower, upper] are masked, the
            rest weighted by min(ratio, cap)), ``decoupled_token`` / ``decoupled_seq`` (AReaL's decoupled PPO, Fu et
            al. 2025: the loss's trust region is around the proximal policy, ``logp_old``, the trainer's forward at
            the current weights, and the behaviour policy that sampled the tokens, ``logp_rollout``, per token
            whatever version produced it, is corrected by ``w = pi_prox / pi_behav`` per token / per sequence;
            weights above the cap are 0, their tokens still counted in the denominators, as AReaL does).
        cap: the truncation C of the IS weight (> 0).
        lower / upper: the accepted band of the ratio (0 < lower < upper).
    """

    kind: str = "none"
    cap: float | None = None
    lower: float | None = None
    upper: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in CORRECTION_DEFAULTS:
            raise ValueError(f"unknown rollout_correction {self.kind!r}; valid: {', '.join(CORRECTION_DEFAULTS)}")
        used = CORRECTION_DEFAULTS[self.kind]
        for name in ("cap", "lower", "upper"):
            value = getattr(self, name)
            if value is not None and name not in used:
                raise ValueError(f"rollout_correction {self.kind!r} has no bound {name!r} (it uses {sorted(used)})")
            if value is None and name in used:
                object.__setattr__(self, name, used[name])
        if self.cap is not None and not self.cap > 0:
            raise ValueError(f"rollout correction cap must be > 0, got {self.cap}")
        if self.lower is not None and not 0 < self.lower < self.upper:
            raise ValueError(f"rollout correction bounds need 0 < lower < upper, got lower={self.lower} "
                             f"upper={self.upper}")


@dataclass(frozen=True)
class Correction:
    """``weights [B, T]`` (stop-gradient, 0 at dropped tokens and padding), ``mask_out [B, T]`` and the metrics;
    ``log_ratio`` (d, 0 off the valid tokens) and ``valid`` let :meth:`counted` redo the metrics at other counts."""

    weights: Tensor
    mask_out: Tensor
    metrics: dict[str, Tensor]
    log_ratio: Tensor
    valid: Tensor

    def counted(self, counts: tuple[float, float]) -> Correction:
        """Its metrics as partial means over the mini-batch's (valid, kept) `counts` (:func:`correction_counts`)."""
        return replace(self, metrics=_metrics(self.log_ratio, self.valid, self.mask_out.to(torch.bool), self.weights,
                                               counts))


def apply_rollout_correction(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, config: CorrectionConfig,
                             counts: tuple[float, float] | None = None) -> Correction:
    """Weights, mask and metrics of ``config`` for one micro-batch.

    Args:
        counts: global (valid tokens, kept tokens) of the whole mini-batch, so metrics are partial means that sum
            over micro-batches and ranks; default: this micro-batch's own counts.
    """
    valid = mask.to(torch.bool)
    dtype = torch.promote_types(logp_old.dtype, torch.float32)
    d = torch.where(valid, logp_old.detach().to(dtype) - logp_rollout.detach().to(dtype), 0.0)
    token_ratio = torch.exp(d)
    seq_ratio = torch.exp(d.sum(-1, keepdim=True)).expand_as(d)
    keep = valid
    if config.kind == "none":
        weights = torch.ones_like(d)
    elif config.kind == "tis_token":
        weights = torch.clamp(token_ratio, max=config.cap)
    elif config.kind == "tis_seq":
        weights = torch.clamp(seq_ratio, max=config.cap)
    elif config.kind == "icepop_token":
        in_band = (token_ratio >= config.lower) & (token_ratio <= config.upper)
        weights = torch.where(in_band, token_ratio, 0.0)
    elif config.kind == "decoupled_token":
        weights = torch.where(token_ratio <= config.cap, token_ratio, 0.0)
    elif config.kind == "decoupled_seq":
        weights = torch.where(seq_ratio <= config.cap, seq_ratio, 0.0)
    else:  # mis_seq
        keep = valid & (seq_ratio >= config.lower) & (seq_ratio <= config.upper)
        weights = torch.clamp(seq_ratio, max=config.cap)
    weights = torch.where(keep, weights, 0.0)
    return Correction(weights=weights, mask_out=keep.to(mask.dtype), log_ratio=d, valid=valid,
                      metrics=_metrics(d, valid, keep, weights, counts))


def _metrics(d: Tensor, valid: Tensor, keep: Tensor, weights: Tensor,
             counts: tuple[float, float] | None) -> dict[str, Tensor]:
    rejected = valid & ((weights == 0) | ~keep)
    dtype = d.dtype
    n_valid, n_kept = counts if counts is not None else (float(valid.sum()), float(keep.sum()))
    return {
        "mismatch_k1": masked_partial_mean(-d, valid, n_valid),
        "mismatch_k3": masked_partial_mean(torch.expm1(-d) + d, valid, n_valid),
        "masked_frac": masked_partial_mean(rejected.to(dtype), valid, n_valid),
        **stats("is_weight", weights, keep, n_kept),
    }


def correction_counts(masks: Sequence[Tensor], corrections: Sequence[Correction],
                      process_group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """Global (valid tokens, kept tokens) of a mini-batch's micro-batches (all-reduced over ``process_group``), the
    ``counts`` that make correction metrics partial means. Compute the loss denominators over the corrections'
    ``mask_out`` (``compute_global_denominators([c.mask_out for c in corrections], ...)``)."""
    sums = torch.tensor([sum(float(m.to(torch.bool).sum()) for m in masks),
                         sum(float(c.mask_out.to(torch.bool).sum()) for c in corrections)], dtype=torch.float64)
    if process_group is not None and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        all_reduce_(sums, group=process_group)
    return float(sums[0]), float(sums[1])
