"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary on any rank.

Each TP rank holds logits for its slice of the (padded) vocabulary. Per chunk of tokens we all-reduce a max, then one
packed [sum exp, target logit, sum exp*x] triple, so communication is O(tokens), never O(tokens x vocab). The backward
recomputes the softmax chunk by chunk from the saved per-token log-sum-exp and entropy, so what autograd keeps is the
logits themselves plus two floats per token: peak extra memory is one fp32 chunk, not a full fp32 copy of the logits.
Padded vocabulary entries (ids >= vocab_size) are excluded from the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Working-set budget per chunk, in logits elements (64 MiB of fp32): chunk_tokens = budget // local vocab size.
CHUNK_ELEMENTS = 1 << 24
DEFAULT_CHUNK_TOKENS: int | None = None  # None: derive from CHUNK_ELEMENTS


def _tp_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 at least (bf16 logits are upcast); fp64 stays fp64 (reference computations)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, size: int) -> None:
    if size > 1:
        dist.all_reduce(tensor, op=op, group=group)


def chunk_statistics(x: torch.Tensor, target: torch.Tensor, valid: int, group, size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's (log p(target), entropy, log-sum-exp) per token from its fp32 logits `x` [c, valid] over this
    rank's unpadded columns (modified in place); `target`: the labels minus this rank's first vocabulary id. Two
    all-reduces over the tensor-parallel group: a max, then one packed [sum exp, target logit, sum exp*x] triple."""
    on_rank = (target >= 0) & (target < valid)
    rows = x.shape[0]
    gmax = x.max(dim=-1).values if valid > 0 else x.new_full((rows,), -torch.inf)
    _all_reduce(gmax, dist.ReduceOp.MAX, group, size)
    shifted = x.sub_(gmax[:, None])
    exp = shifted.exp()
    target_logit = shifted.gather(1, target.clamp(0, max(valid - 1, 0))[:, None]).squeeze(1) if valid else \
        shifted.new_zeros(rows)
    stats = torch.stack([exp.sum(-1), torch.where(on_rank, target_logit, 0.0), torch.linalg.vecdot(exp, shifted)])
    del exp
    _all_reduce(stats, dist.ReduceOp.SUM, group, size)
    sum_exp, target_shifted, sum_exp_x = stats
    log_z = sum_exp.log()
    # H = log Z - E_p[x] (in shifted coordinates)
    return target_shifted - log_z, log_z - sum_exp_x / sum_exp, log_z + gmax


def chunk_logit_grad(x: torch.Tensor, target: torch.Tensor, valid: int, lse: torch.Tensor, entropy: torch.Tensor,
                     g_logp: torch.Tensor, g_ent: torch.Tensor) -> torch.Tensor:
    """The gradient [c, valid] of one chunk's fp32 logits `x` (modified in place) from the upstream gradients of its
    log-probs and entropies, given the forward's per-token log-sum-exp and entropy:
    d logp / dx_j = 1[j = label] - p_j ;  d H / dx_j = -p_j (x_j - E_p[x]),  E_p[x] = lse - H."""
    lse, ent = lse[:, None], entropy[:, None]
    # In place on one fp32 copy: centered = x - E_p[x]; p = exp(x - lse) = exp(centered - H).
    centered = x.sub_(lse - ent)
    p = (centered - ent).exp_()
    g = centered.mul_(g_ent[:, None]).add_(g_logp[:, None]).mul_(p).neg_()
    del p
    on_rank = (target >= 0) & (target < valid)
    rows = on_rank.nonzero().squeeze(1)
    g[rows, target[rows]] += g_logp[rows]
    return g


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group, chunk_tokens: int):
        rank, size = _tp_rank_size(group)
        local_vocab = logits.shape[-1]
        vocab_start = rank * local_vocab
        valid = max(0, min(local_vocab, vocab_size - vocab_start))  # this rank's unpadded columns
        flat = logits.reshape(-1, local_vocab)
        flat_labels = labels.reshape(-1)
        n = flat.shape[0]
        chunk_tokens = chunk_tokens or max(1, CHUNK_ELEMENTS // max(local_vocab, 1))
        logp = torch.empty(n, dtype=_compute_dtype(logits), device=logits.device)
        entropy = torch.empty_like(logp)
        lse_all = torch.empty_like(logp)
        for start in range(0, n, chunk_tokens):
            x = flat[start : start + chunk_tokens, :valid].to(logp.dtype, copy=True)  # modified in place
            chunk = slice(start, start + x.shape[0])
            logp[chunk], entropy[chunk], lse_all[chunk] = chunk_statistics(
                x, flat_labels[chunk] - vocab_start, valid, group, size)
        ctx.save_for_backward(logits, labels, lse_all, entropy)
        ctx.meta = (vocab_size, group, chunk_tokens, valid, vocab_start)
        return logp.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        logits, labels, lse_all, entropy = ctx.saved_tensors
        vocab_size, group, chunk_tokens, valid, vocab_start = ctx.meta
        local_vocab = logits.shape[-1]
        flat = logits.reshape(-1, local_vocab)
        flat_labels = labels.reshape(-1)
        g_logp = grad_logp.reshape(-1).to(lse_all.dtype) if grad_logp is not None else torch.zeros_like(lse_all)
        g_ent = grad_entropy.reshape(-1).to(lse_all.dtype) if grad_entropy is not None else torch.zeros_like(lse_all)
        grad = torch.zeros_like(flat)
        for start in range(0, flat.shape[0], chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            x = flat[chunk, :valid].to(lse_all.dtype, copy=True)
            g = chunk_logit_grad(x, flat_labels[chunk] - vocab_start, valid, lse_all[chunk], entropy[chunk],
                                 g_logp[chunk], g_ent[chunk])
            grad[chunk, :valid] = g.to(grad.dtype)
        return grad.view_as(logits), None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                            tp_group: dist.ProcessGroup | None = None,
                            chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(labels) and the entropy of each position's distribution, in fp32 (fp64 for fp64 logits).

    Args:
        logits: [..., V_local] this rank's vocab slice (rank r holds ids [r*V_local, (r+1)*V_local)).
        labels: [...] global token ids to score.
        vocab_size: the real vocabulary; padded ids at or above it are excluded from the softmax.
        tp_group: the tensor-parallel group the vocabulary is split over (None: not split).
        chunk_tokens: tokens processed at once; bounds the fp32 working memory (None: CHUNK_ELEMENTS // V_local).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on leading dims")
    return _VocabParallelLogProbEntropy.apply(logits, labels, vocab_size, tp_group, chunk_tokens)


def next_token_logprobs(output: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                        tp_group: dist.ProcessGroup | None = None, chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                        head_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(labels) and entropies at each position of `output`: this rank's vocab slice of the logits
    [..., V_local], or with `head_weight` ([V_local, H]) the LM head's input [..., H], the head then applied chunk by
    chunk inside the scoring (mpo.models.fused_head): no [tokens, vocab] tensor is ever whole."""
    if head_weight is None:
        return vocab_parallel_logprobs(output, labels, vocab_size=vocab_size, tp_group=tp_group,
                                       chunk_tokens=chunk_tokens)
    from mpo.models.fused_head import fused_head_logprobs

    return fused_head_logprobs(output, head_weight, labels, vocab_size=vocab_size, tp_group=tp_group,
                               chunk_tokens=chunk_tokens)


def sequence_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, *, vocab_size: int,
                      tp_group: dist.ProcessGroup | None = None, position_ids: torch.Tensor | None = None,
                      chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                      head_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of `input_ids` [b, s] under causal-LM logits [b, s, V_local].

    out[:, t] scores token t with the logits at position t-1; out[:, 0] is 0. With packed rows, pass position_ids
    (they restart at 0 for each packed sequence): a sequence's first token has no prediction and also gets 0.
    With `head_weight`, `logits` are the LM head's input [b, s, H] instead (see next_token_logprobs).
    """
    logp, entropy = next_token_logprobs(logits[:, :-1], input_ids[:, 1:], vocab_size=vocab_size, tp_group=tp_group,
                                        chunk_tokens=chunk_tokens, head_weight=head_weight)
    return token_scores(logp, entropy, position_ids)


def token_scores(next_logp: torch.Tensor, next_entropy: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the next token at each position ([b, s - 1], or [b, s] whose last column is dropped) -> scores of
    each token [b, s]: out[:, t] from position t - 1, 0 at t = 0 and where a packed sequence starts."""
    width = position_ids.shape[1] if position_ids is not None else next_logp.shape[1] + 1
    next_logp, next_entropy = next_logp[:, :width - 1], next_entropy[:, :width - 1]
    zero = next_logp.new_zeros(next_logp.shape[0], 1)
    logp, entropy = torch.cat([zero, next_logp], 1), torch.cat([zero, next_entropy], 1)
    if position_ids is not None:
        starts = position_ids == 0
        logp, entropy = logp.masked_fill(starts, 0.0), entropy.masked_fill(starts, 0.0)
    return logp, entropy
