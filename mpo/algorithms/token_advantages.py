"""Token-level advantage estimators: REINFORCE++ (with and without a group
baseline), GAE and VAPO's decoupled GAE, plus the running-mean (EMA) baseline of REINFORCE.

All work on ``[B, T]`` response tokens with a ``mask`` (1 = response token); outputs are exactly 0 at padding.
Whitening is over **all valid tokens of the global batch**: pass the data-parallel group as ``process_group`` and
the sums behind the mean and the unbiased variance are all-reduced first, so every rank whitens with the same
statistics as one big batch would. ``values`` (GAE/VAPO) are the critic's ``V_t`` for the state before response token
t; their padded entries may hold garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mpo.parallel.collectives import all_reduce_

from .advantage_registry import get_advantage, register_advantage
from .advantages import group_stats

WHITEN_EPS = 1e-8


@dataclass(frozen=True)
class TokenAdvantages:
    """``advantages [B, T]`` for the policy; ``returns [B, T]`` value targets (GAE/VAPO, REINFORCE++ returns), else
    None; ``lambda_policy [B]`` the per-row GAE lambda of VAPO, else None."""

    advantages: Tensor
    returns: Tensor | None = None
    lambda_policy: Tensor | None = None


def masked_whiten(x: Tensor, mask: Tensor, process_group: dist.ProcessGroup | None = None) -> Tensor:
    """``(x - mean) / sqrt(var_unbiased + 1e-8)`` over the valid entries of the global batch; 0 at padding."""
    valid = mask.to(torch.bool)
    x64 = torch.where(valid, x.to(torch.float64), 0.0)
    sums = torch.stack([valid.sum().to(torch.float64), x64.sum(), (x64 * x64).sum()])
    if process_group is not None and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        all_reduce_(sums, group=process_group)
    n, s, ss = sums
    mean = s / n.clamp(min=1)
    var = (ss - n * mean * mean) / (n - 1).clamp(min=1)  # unbiased, as verl's masked_whiten
    return torch.where(valid, (x64 - mean) * torch.rsqrt(var + WHITEN_EPS), 0.0)


def _last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` with each row's outcome reward at its last valid token."""
    valid = mask.to(torch.bool)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(valid)
    last = torch.where(valid, positions, -1).amax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.to(torch.float64)[rows]
    return out


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = sum_{s >= t} gamma^(s-t) R_s`` over valid tokens (padding contributes nothing, holds 0)."""
    valid = mask.to(torch.bool)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float64, device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, 0.0)
    return out


def _gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: Tensor) -> Tensor:
    """Raw GAE over valid tokens: ``delta_t = R_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next``.

    Padding is skipped (the next valid token is the successor) and V after a row's last token is 0. ``lam`` is a
    scalar or per-row ``[B]`` tensor.
    """
    valid = mask.to(torch.bool)
    v = torch.where(valid, values.to(torch.float64), 0.0)
    lam = torch.as_tensor(lam, dtype=torch.float64, device=v.device).expand(v.shape[0])
    adv = torch.zeros_like(v)
    next_value = torch.zeros(v.shape[0], dtype=torch.float64, device=v.device)
    running = torch.zeros_like(next_value)
    for t in reversed(range(v.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * running
        running = torch.where(valid[:, t], step, running)
        next_value = torch.where(valid[:, t], v[:, t], next_value)
        adv[:, t] = torch.where(valid[:, t], running, 0.0)
    return adv


@register_advantage("reinforce_pp", level="token", args=("gamma",))
def reinforce_pp(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, kl: Tensor | None = None,
                 kl_coef: float = 0.0, process_group: dist.ProcessGroup | None = None, **_: Any) -> TokenAdvantages:
    """REINFORCE++: outcome reward at the last token minus ``kl_coef * kl_t`` on every token, discounted returns,
    whitened over the global batch."""
    token_rewards = _last_token_rewards(rewards, mask)
    if kl_coef:
        if kl is None:
            raise ValueError("reinforce_pp with kl_coef > 0 needs the per-token kl (old vs reference)")
        token_rewards = token_rewards - kl_coef * torch.where(mask.to(torch.bool), kl.to(torch.float64), 0.0)
    returns = _discounted_returns(token_rewards, mask, gamma)
    return TokenAdvantages(masked_whiten(returns, mask, process_group), returns=returns)


@register_advantage("reinforce_pp_baseline", level="token", needs_groups=True)
def reinforce_pp_baseline(rewards: Tensor, mask: Tensor, *, group_ids: Tensor,
                          process_group: dist.ProcessGroup | None = None, **_: Any) -> TokenAdvantages:
    """``r_i - mean_group`` (a singleton group's mean is 0), broadcast to the row's tokens, whitened globally."""
    g = group_stats(rewards, group_ids)
    centered = rewards.to(torch.float64) - torch.where(g.singleton, 0.0, g.mean)
    per_token = torch.where(mask.to(torch.bool), centered[:, None], 0.0)
    return TokenAdvantages(masked_whiten(per_token, mask, process_group))


@register_advantage("gae", level="token", args=("gamma", "lam"), needs_critic=True)
def gae(rewards: Tensor, mask: Tensor, *, values: Tensor, gamma: float = 1.0, lam: float = 0.95,
        process_group: dist.ProcessGroup | None = None, **_: Any) -> TokenAdvantages:
    """PPO's GAE: ``returns = A_raw + V`` are the critic's targets; the policy gets whitened ``A_raw``."""
    raw = _gae(_last_token_rewards(rewards, mask), values, mask, gamma, torch.tensor(lam, dtype=torch.float64))
    returns = torch.where(mask.to(torch.bool), raw + values.to(torch.float64), 0.0)
    return TokenAdvantages(masked_whiten(raw, mask, process_group), returns=returns)


@register_advantage("vapo", level="token", args=("gamma", "alpha", "lam_value"), needs_critic=True)
def vapo(rewards: Tensor, mask: Tensor, *, values: Tensor, gamma: float = 1.0, alpha: float = 0.05,
         lam_value: float = 1.0, process_group: dist.ProcessGroup | None = None, **_: Any) -> TokenAdvantages:
    """VAPO's decoupled, length-adaptive GAE: the policy uses ``lam_i = clip(1 - 1/(alpha |y_i|), 0, 1)``, the value
    targets use ``lam_value`` (1.0: Monte-Carlo returns)."""
    token_rewards = _last_token_rewards(rewards, mask)
    length = mask.to(torch.float64).sum(-1)
    lam_policy = (1.0 - 1.0 / (alpha * length.clamp(min=1))).clamp(0.0, 1.0)
    raw = _gae(token_rewards, values, mask, gamma, lam_policy)
    value_adv = _gae(token_rewards, values, mask, gamma, torch.tensor(lam_value, dtype=torch.float64))
    returns = torch.where(mask.to(torch.bool), value_adv + values.to(torch.float64), 0.0)
    return TokenAdvantages(masked_whiten(raw, mask, process_group), returns=returns, lambda_policy=lam_policy)


def compute_token_advantages(estimator: str, rewards: Tensor, mask: Tensor, **kwargs: Any) -> TokenAdvantages:
    """Dispatch to a token-level estimator by name (mpo.algorithms.advantage_registry)."""
    spec = get_advantage(estimator, level="token")
    if spec.needs_critic and kwargs.get("values") is None:
        raise ValueError(f"advantage estimator {estimator!r} needs the critic's values")
    return spec.fn(rewards, mask, **kwargs)


@register_advantage("reinforce_ema", level="running", args=("beta",))
class EMABaseline:
    """REINFORCE with a running baseline: ``A_i = r_i - b``, then ``b <- beta b + (1 - beta) mean(r_batch)``.

    The first batch uses its own mean as b. ``b`` is trainer state: save :meth:`state_dict` with the checkpoint. The
    batch mean is over the global batch: pass the rewards of every rank (the trainer scores on rank 0).
    """

    def __init__(self, beta: float = 0.9) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"reinforce_ema beta must be in [0, 1), got {beta}")
        self.beta = beta
        self.baseline: float | None = None

    def __call__(self, rewards: Tensor) -> tuple[Tensor, float]:
        """Advantages ``[N]`` of this batch and the baseline they used; updates the baseline."""
        r = rewards.to(torch.float64)
        mean = float(r.mean()) if r.numel() else 0.0
        used = mean if self.baseline is None else self.baseline
        self.baseline = self.beta * used + (1.0 - self.beta) * mean
        return r - used, used

    def state_dict(self) -> dict[str, float | None]:
        return {"beta": self.beta, "baseline": self.baseline}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.beta = float(state["beta"])
        self.baseline = None if state["baseline"] is None else float(state["baseline"])
