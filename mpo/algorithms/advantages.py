"""Outcome-reward advantage estimators over prompt groups (GRPO, Dr.GRPO, RLOO, batch-std, MaxRL).

Every estimator returns one advantage per response; broadcast it to tokens with ``A[i, t] = A_i * mask[i, t]``.
Singleton groups have no baseline: by default (``singleton="zero"``) they get A = 0; ``singleton="verl"`` reproduces
verl (group mean 0 and std 1, so ``grpo`` gives r/(1+eps), ``drgrpo`` gives r, ``batchstd`` r/(std_batch+eps), and
``rloo`` gives 0 as its vectorised version does). Groups whose rewards are all equal (singletons included) carry no
learning signal; they are reported in ``zero_variance`` so the trainer can drop them (DAPO dynamic sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .advantage_registry import get_advantage, register_advantage

SINGLETON_MODES: tuple[str, ...] = ("zero", "verl")


@dataclass(frozen=True)
class GroupStats:
    """Per-response statistics of the response's group (all ``[N]``)."""

    size: Tensor
    mean: Tensor
    std: Tensor  # unbiased (ddof=1); 0 for singletons
    singleton: Tensor


@dataclass(frozen=True)
class AdvantageOutput:
    """``advantages [N]`` and ``zero_variance [N]`` (True where the response's group has all-equal rewards)."""

    advantages: Tensor
    zero_variance: Tensor


def group_stats(rewards: Tensor, group_ids: Tensor) -> GroupStats:
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count
    sq = torch.zeros_like(count).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    size = count[inverse]
    return GroupStats(size=size, mean=mean[inverse], std=var.sqrt()[inverse], singleton=size < 2)


@register_advantage("grpo", level="response", args=("eps",), needs_groups=True)
def _grpo(r: Tensor, g: GroupStats, eps: float, verl: bool) -> Tensor:
    mean = torch.where(g.singleton & verl, 0.0, g.mean)
    std = torch.where(g.singleton & verl, 1.0, g.std)
    return (r - mean) / (std + eps)


@register_advantage("drgrpo", level="response", args=("eps",))
def _drgrpo(r: Tensor, g: GroupStats, eps: float, verl: bool) -> Tensor:
    return r - torch.where(g.singleton & verl, 0.0, g.mean)


@register_advantage("rloo", level="response", args=("eps",), needs_groups=True)
def _rloo(r: Tensor, g: GroupStats, eps: float, verl: bool) -> Tensor:
    # r_i - mean of the others = G/(G-1) (r_i - mean_g); a singleton has no "others" (0 in both conventions).
    return torch.where(g.singleton, 0.0, g.size / (g.size - 1).clamp(min=1) * (r - g.mean))


@register_advantage("batchstd", level="response", args=("eps",), needs_groups=True)
def _batchstd(r: Tensor, g: GroupStats, eps: float, verl: bool) -> Tensor:
    batch_std = r.std(unbiased=True) if r.numel() > 1 else r.new_zeros(())
    return (r - torch.where(g.singleton & verl, 0.0, g.mean)) / (batch_std + eps)


@register_advantage("maxrl", level="response", args=("eps",), needs_groups=True)
def _maxrl(r: Tensor, g: GroupStats, eps: float, verl: bool) -> Tensor:
    # MaxRL: (r - mu_g) / (mu_g + eps) where the group has any success, else 0.
    return torch.where(g.mean > 0, (r - g.mean) / (g.mean + eps), 0.0)


def compute_advantages(rewards: Tensor, group_ids: Tensor, estimator: str = "grpo", eps: float = 1e-6,
                       singleton: str = "zero") -> AdvantageOutput:
    """Advantages of ``rewards [N]`` grouped by ``group_ids [N]`` (float64).

    Args:
        estimator: ``grpo`` (group mean / unbiased group std), ``drgrpo`` (group mean only), ``rloo``
            (leave-one-out mean), ``batchstd`` (group mean / unbiased std of the whole batch's rewards), ``maxrl``
            ((r - mean) / (mean + eps) in groups with a success). Token-level estimators (REINFORCE++, GAE, VAPO)
            live in :mod:`mpo.algorithms.token_advantages`.
        eps: added to the std (verl 1e-6, TRL 1e-4); ignored by ``drgrpo`` and ``rloo``.
        singleton: ``zero`` (default) or ``verl``, see the module docstring.
    """
    fn = get_advantage(estimator, level="response").fn
    if singleton not in SINGLETON_MODES:
        raise ValueError(f"singleton must be one of {', '.join(SINGLETON_MODES)}, got {singleton!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = rewards.to(torch.float64)
    g = group_stats(r, group_ids)
    verl = torch.tensor(singleton == "verl", device=r.device)
    adv = fn(r, g, eps, verl)
    if singleton == "zero":
        adv = torch.where(g.singleton, 0.0, adv)
    return AdvantageOutput(advantages=adv, zero_variance=g.std == 0)
