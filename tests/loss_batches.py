"""Random float64 batches for the micro-batch / data-parallel / masking tests (garbage at masked positions)."""

from __future__ import annotations

import torch

from mpo.algorithms import PolicyBatch, get_loss, make_loss_config

B, T, LAYERS, TOPK = 12, 9, 3, 2
# Ragged rows incl. an empty one; groups of unequal size that straddle micro-batch and rank boundaries.
ROW_LENGTHS = [9, 3, 0, 5, 1, 7, 9, 2, 6, 4, 8, 1]
GROUP_IDS = [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 4]
NORM_CONST = 11


def random_batch(seed: int = 0, garbage: float = float("nan")) -> dict[str, torch.Tensor]:
    """Full mini-batch tensors. Masked positions hold ``garbage`` so any leak shows up as NaN."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(ROW_LENGTHS)[:, None]).to(torch.float64)
    valid = mask.bool()
    logp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp_new = logp_old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    logp_ref = logp_old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv_row = torch.randn(B, generator=g, dtype=torch.float64)
    adv_row[3] = 0.0
    advantages = adv_row[:, None].expand(B, T).clone()
    router_old = -torch.rand(B, T, LAYERS, TOPK, generator=g, dtype=torch.float64) * 2
    router_new = router_old + torch.randn(B, T, LAYERS, TOPK, generator=g, dtype=torch.float64) * 0.3
    # the engine's log-probs: drawn after everything else, so the batches of existing seeds are unchanged
    logp_rollout = logp_old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.15

    def dirty(x: torch.Tensor) -> torch.Tensor:
        v = valid.reshape(valid.shape + (1,) * (x.dim() - 2))
        return torch.where(v, x, torch.full_like(x, garbage))

    return {
        "logp_new": dirty(logp_new), "logp_old": dirty(logp_old), "logp_ref": dirty(logp_ref),
        "advantages": dirty(advantages), "mask": mask, "group_ids": torch.tensor(GROUP_IDS),
        "router_logp_new": dirty(router_new), "router_logp_old": dirty(router_old),
        "logp_rollout": dirty(logp_rollout),
    }


def loss_config(name: str, agg: str):
    """Config of ``name`` with ``agg``, loose clip bounds so that clipped and unclipped tokens both occur."""
    overrides = {"agg": agg, "norm_const": NORM_CONST, "kl_coef": 0.05}
    if get_loss(name).config_cls.__name__.startswith("GSPO"):
        overrides.update(eps_low=0.05, eps_high=0.05)
    return make_loss_config(name, **overrides)


def make_batch(tensors: dict[str, torch.Tensor], rows: slice, logp_new: torch.Tensor,
               with_rollout: bool = False) -> PolicyBatch:
    """A micro-batch of ``rows``, trimmed to its own padded length (micro-batches differ in T); ``with_rollout``
    adds the engine's log-probs (rollout correction)."""
    t_max = max(1, int(tensors["mask"][rows].sum(-1).max().item()))
    cut = lambda x: x[rows, :t_max]  # noqa: E731
    return PolicyBatch(
        logp_new=logp_new[:, :t_max], logp_old=cut(tensors["logp_old"]), advantages=cut(tensors["advantages"]),
        mask=cut(tensors["mask"]), group_ids=tensors["group_ids"][rows], logp_ref=cut(tensors["logp_ref"]),
        router_logp_new=cut(tensors["router_logp_new"]), router_logp_old=cut(tensors["router_logp_old"]),
        logp_rollout=cut(tensors["logp_rollout"]) if with_rollout else None,
    )
