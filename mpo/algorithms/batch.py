"""Inputs, per-call context and output of a policy loss."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import Tensor

from .aggregation import GlobalDenominators, safe_div
from .metrics import masked_partial_mean
from .router_shift import RouterShift


@dataclass
class PolicyBatch:
    """One micro-batch of scored response tokens, all ``[B, T]`` unless noted.

    Attributes:
        logp_new: current-policy log-probs of the response tokens (differentiable; any float dtype, e.g. bf16).
        logp_old: log-probs under the sampling (old) policy.
        advantages: per-token advantages (an outcome estimator broadcasts one scalar per row).
        mask: 1 for valid response tokens, 0 for padding; values at masked positions may be garbage.
        group_ids: ``[B]`` global prompt-group ids (needed by ``prompt-mean-token-mean``).
        logp_ref: reference-policy log-probs (needed when ``kl_coef > 0``).
        router_logp_new / router_logp_old: ``[B, T, L, K]`` router log-probs (log_softmax over all experts) at the
            old top-K experts, for router-shift losses (``rspo``, ``*+rs``).
        router_shift: precomputed router shift (e.g. after the pipeline-parallel all-reduce of
            :func:`~mpo.algorithms.router_shift.router_shift_sum`); takes precedence over the router log-probs.
        entropy: optional per-token policy entropy, reported as the ``entropy`` metric.
        logp_rollout: the rollout engine's log-probs of the response tokens: rollout correction and its mismatch
            metrics, DPPO's ``anchor="rollout"``.
    """

    logp_new: Tensor
    logp_old: Tensor
    advantages: Tensor
    mask: Tensor
    group_ids: Tensor | None = None
    logp_ref: Tensor | None = None
    router_logp_new: Tensor | None = None
    router_logp_old: Tensor | None = None
    router_shift: RouterShift | None = None
    entropy: Tensor | None = None
    logp_rollout: Tensor | None = None


@dataclass
class LossOutput:
    """The scalar loss of this micro-batch (already weighted by global denominators) and its metrics.

    Metrics follow :mod:`mpo.algorithms.metrics`: partial means (sum them over micro-batches and ranks) and
    ``*_min``/``*_max`` (combine with min/max).
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class LossContext:
    """What a loss function sees: inputs with padding neutralised, weights and global counts.

    ``log_ratio``, ``advantages`` and ``logp_new`` are exactly 0 at masked positions (via ``torch.where``, so no garbage
    reaches an ``exp`` and masked positions get exactly zero gradient). Computation runs in at least fp32.
    """

    valid: Tensor
    logp_new: Tensor
    log_ratio: Tensor
    advantages: Tensor
    weights: Tensor
    denoms: GlobalDenominators
    shift: RouterShift | None = None
    logp_rollout: Tensor | None = None

    @classmethod
    def build(cls, batch: PolicyBatch, weights: Tensor, denoms: GlobalDenominators,
              shift: RouterShift | None) -> LossContext:
        valid = batch.mask.to(torch.bool)
        dtype = torch.promote_types(batch.logp_new.dtype, torch.float32)
        zero = torch.zeros((), dtype=dtype, device=valid.device)
        logp_new = torch.where(valid, batch.logp_new.to(dtype), zero)
        log_ratio = torch.where(valid, logp_new - batch.logp_old.detach().to(dtype), zero)
        adv = torch.where(valid, batch.advantages.detach().to(dtype), zero)
        if shift is not None:
            shift = replace(shift, log_gamma=torch.where(valid, shift.log_gamma.detach().to(dtype), zero))
        rollout = batch.logp_rollout
        logp_rollout = None if rollout is None else torch.where(valid, rollout.detach().to(dtype), zero)
        return cls(valid, logp_new, log_ratio, adv, weights.to(dtype), denoms, shift, logp_rollout)

    @property
    def log_gamma(self) -> Tensor:
        """log sg(gamma) per token (0 when the loss has no router shift)."""
        return self.shift.log_gamma if self.shift is not None else torch.zeros_like(self.log_ratio)

    # --- row (sequence) level ---
    @cached_property
    def row_len(self) -> Tensor:
        return self.valid.sum(-1).to(self.log_ratio.dtype)

    @cached_property
    def row_nonempty(self) -> Tensor:
        return self.row_len > 0

    @cached_property
    def row_weights(self) -> Tensor:
        """``W_i = sum_t w[i,t]``: the weight of a sequence-level loss broadcast to the row's valid tokens."""
        return self.weights.sum(-1)

    @cached_property
    def seq_advantages(self) -> Tensor:
        """``A_i`` = masked mean of the token advantages (0 for an empty row)."""
        return safe_div(self.advantages.sum(-1), self.row_len)

    def row_mean_log(self, x: Tensor) -> Tensor:
        """Masked mean over each row of a per-token quantity that is already 0 at masked positions."""
        return safe_div(x.sum(-1), self.row_len)

    # --- metric helpers (partial means over the global mini-batch) ---
    def token_mean(self, x: Tensor, where: Tensor | None = None) -> Tensor:
        sel = self.valid if where is None else self.valid & where
        return masked_partial_mean(x.detach().to(self.log_ratio.dtype), sel, self.denoms.num_tokens)

    def token_frac(self, cond: Tensor) -> Tensor:
        return self.token_mean(torch.ones_like(self.log_ratio), cond)

    def clip_fracs(self, high: Tensor, low: Tensor) -> dict[str, Tensor]:
        """clipfrac_high / clipfrac_low (the tokens clipped at each bound) and clipfrac, their sum."""
        fracs = {"clipfrac_high": self.token_frac(high), "clipfrac_low": self.token_frac(low)}
        return {**fracs, "clipfrac": fracs["clipfrac_high"] + fracs["clipfrac_low"]}

    def row_mean(self, x: Tensor, where: Tensor | None = None) -> Tensor:
        sel = self.row_nonempty if where is None else self.row_nonempty & where
        return masked_partial_mean(x.detach().to(self.log_ratio.dtype), sel, self.denoms.num_nonempty_rows)
