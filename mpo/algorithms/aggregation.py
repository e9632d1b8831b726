"""Token weights for the loss-aggregation modes, with denominators over the whole optimizer mini-batch.

A loss is ``L = sum_{i,t} w[i,t] * ell[i,t]``. The weights of every mode are ``mask / denominator`` where the
denominator is a count over the *global* optimizer mini-batch (all micro-batches, all data-parallel ranks). Those counts
live in :class:`GlobalDenominators`, computed once per optimizer step by :func:`compute_global_denominators`. Because
each micro-batch then contributes its exact share of the full-batch loss, summing micro-batch gradients (gradient
accumulation) and summing across DP ranks (all-reduce SUM, not AVG) reproduces the one-big-batch gradient.

Rows are never split across micro-batches or ranks (no context parallelism here), so per-row token counts
``|y_i|`` are local; per-group token counts are global because a prompt's responses may land in different micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mpo.parallel.collectives import all_reduce_

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
PROMPT_MEAN_TOKEN_MEAN = "prompt-mean-token-mean"
AGG_MODES: tuple[str, ...] = (TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_SUM_NORM,
                              PROMPT_MEAN_TOKEN_MEAN)


@dataclass(frozen=True)
class GlobalDenominators:
    """Counts over the whole optimizer mini-batch (all micro-batches and DP ranks).

    Attributes:
        num_tokens: valid response tokens (``token-mean``; also the denominator of every token-mean metric).
        num_rows: all rows including fully masked ones (``B_total`` of ``seq-mean-token-sum-norm``).
        num_nonempty_rows: rows with at least one valid token (``N_ne``; row-level metrics).
        num_nonempty_groups: prompt groups with at least one valid token (``prompt-mean-token-mean``).
        group_num_tokens: ``[num_groups]`` valid tokens per group, indexed by the global group id; ``None`` when no
            group ids were given.
        num_pos_adv_tokens / num_nonpos_adv_tokens: valid tokens with A>0 / A<=0, the denominators of the metrics
            split by which SAPO temperature applies (``sapo_grad_weight_mean_pos/neg``; A=0 uses tau_neg);
            ``None`` when no advantages were given.
    """

    num_tokens: float
    num_rows: float
    num_nonempty_rows: float
    num_nonempty_groups: float = 0.0
    group_num_tokens: Tensor | None = None
    num_pos_adv_tokens: float | None = None
    num_nonpos_adv_tokens: float | None = None


def _as_list(x: Tensor | Sequence[Tensor] | None) -> list[Tensor] | None:
    if x is None:
        return None
    return [x] if isinstance(x, Tensor) else list(x)


def compute_global_denominators(mask: Tensor | Sequence[Tensor], group_ids: Tensor | Sequence[Tensor] | None = None,
                                advantages: Tensor | Sequence[Tensor] | None = None, num_groups: int | None = None,
                                process_group: dist.ProcessGroup | None = None) -> GlobalDenominators:
    """Count the denominators of one optimizer step.

    Call it once per optimizer step on this rank's whole mini-batch: one tensor, or the list of its micro-batches
    (they may differ in padded length). Pass the data-parallel group (``dist.group.WORLD`` for the default group) as
    ``process_group`` to all-reduce (SUM) the counts over the DP ranks; ``None`` means no all-reduce. ``group_ids`` must
    be global prompt ids in ``[0, num_groups)``; ``num_groups`` defaults to ``max id + 1`` (MAX across ranks).
    Pass ``advantages`` to get the A>0 / A<=0 token counts that sign-split metrics (SAPO) need.
    """
    masks, gids, advs = _as_list(mask), _as_list(group_ids), _as_list(advantages)
    device = masks[0].device
    valid = [m.to(torch.bool) for m in masks]
    row_len = torch.cat([v.sum(-1) for v in valid]).to(torch.float64)
    use_dist = process_group is not None and dist.is_available() and dist.is_initialized()

    counts = [row_len.sum(), torch.tensor(float(row_len.numel()), dtype=torch.float64, device=device),
              (row_len > 0).sum().to(torch.float64)]
    if advs is not None:
        pos = sum((v & (a > 0)).sum() for v, a in zip(valid, advs))
        nonpos = sum((v & (a <= 0)).sum() for v, a in zip(valid, advs))
        counts += [torch.as_tensor(pos, dtype=torch.float64, device=device),
                   torch.as_tensor(nonpos, dtype=torch.float64, device=device)]
    group_tokens = None
    if gids is not None:
        gid = torch.cat([g.to(device=device, dtype=torch.long).reshape(-1) for g in gids])
        if num_groups is None:
            n = torch.tensor(int(gid.max()) + 1 if gid.numel() else 0, device=device)
            if use_dist:
                all_reduce_(n, op=dist.ReduceOp.MAX, group=process_group)
            num_groups = int(n)
        group_tokens = torch.zeros(num_groups, dtype=torch.float64, device=device).index_add_(0, gid, row_len)

    flat = torch.stack(counts)
    if group_tokens is not None:
        flat = torch.cat([flat, group_tokens])
    if use_dist:
        all_reduce_(flat, op=dist.ReduceOp.SUM, group=process_group)
    scalars = flat[: len(counts)].tolist()
    group_tokens = flat[len(counts):] if group_tokens is not None else None
    return GlobalDenominators(
        num_tokens=scalars[0], num_rows=scalars[1], num_nonempty_rows=scalars[2],
        num_nonempty_groups=float((group_tokens > 0).sum()) if group_tokens is not None else 0.0,
        group_num_tokens=group_tokens, num_pos_adv_tokens=scalars[3] if advs is not None else None,
        num_nonpos_adv_tokens=scalars[4] if advs is not None else None)


def safe_div(num: Tensor, den: Tensor | float) -> Tensor:
    """num / den with 0 where den == 0 (empty rows/groups/batches get weight 0, never NaN)."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def token_weights(mask: Tensor, agg: str, denoms: GlobalDenominators, group_ids: Tensor | None = None,
                  norm_const: float | None = None) -> Tensor:
    """Per-token aggregation weights ``w[i,t]`` (0 at masked positions) of this micro-batch's rows.

    ``seq-mean-token-sum-norm`` divides by ``num_rows * norm_const`` (Dr.GRPO / TRL form; verl omits ``num_rows``).
    """
    m = mask.to(torch.bool).to(torch.float64)
    row_len = m.sum(-1, keepdim=True)
    if agg == TOKEN_MEAN:
        return safe_div(m, denoms.num_tokens)
    elif agg == SEQ_MEAN_TOKEN_MEAN:
        return safe_div(m, row_len * denoms.num_nonempty_rows)
    elif agg == SEQ_MEAN_TOKEN_SUM:
        return safe_div(m, denoms.num_nonempty_rows)
    elif agg == SEQ_MEAN_TOKEN_SUM_NORM:
        if norm_const is None or norm_const <= 0:
            raise ValueError(f"norm_const must be > 0 for agg={agg!r} (the max response length), got {norm_const}")
        return safe_div(m, denoms.num_rows * float(norm_const))
    elif agg == PROMPT_MEAN_TOKEN_MEAN:
        if group_ids is None or denoms.group_num_tokens is None:
            raise ValueError(f"agg={agg!r} needs group_ids in the batch and in compute_global_denominators")
        g_tok = denoms.group_num_tokens.to(mask.device)[group_ids.to(device=mask.device, dtype=torch.long)]
        return safe_div(m, g_tok.unsqueeze(-1) * denoms.num_nonempty_groups)
    else:
        raise ValueError(f"unknown aggregation mode agg={agg!r}; valid modes: {', '.join(AGG_MODES)}")
