"""The LM head fused with log-probs and entropy: hidden states -> (log p(label), entropy), never [tokens, vocab] whole.

At 32k-token responses and Qwen3's 151,936-token vocabulary, the head's fp32 logits are ~20 GB per micro-batch and their
gradient as much again. Here the head's matmul runs chunk by chunk over tokens: each chunk's logits [c, V_local] are
made, reduced to three floats per token (over the tensor-parallel group when the vocabulary is split), and dropped.
The backward recomputes each chunk's logits from the saved hidden states and the weight, forms that chunk's logit
gradient, and turns it straight into the hidden-state gradient and a running weight gradient. What autograd keeps is
the head's input (which the unfused head keeps too) and two floats per token; the peak extra memory is one chunk.

The numbers are the unfused path's (mpo.models.logprobs over the output layer's logits): the same matmul in the head's
dtype per chunk (fp32 with the FP32 LM head), the same fp32 softmax statistics, padded vocabulary ids excluded.

`deferred_head` makes megatron's output layer hand back its input instead of logits for the duration of a schedule
run (mpo.models.forward): the gather over the sequence-parallel region (or the copy into the tensor-parallel region)
that ColumnParallelLinear does is done here, so gradients reach the body exactly as through the unfused layer.
Whole logits are still made where they are asked for (`run_microbatches(keep_logits=True)`: parity tests and debug
dumps), never on the training path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from mpo.models.logprobs import (CHUNK_ELEMENTS, _compute_dtype, _tp_rank_size, chunk_logit_grad,
                                 chunk_statistics)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, valid: int, dtype: torch.dtype) -> torch.Tensor:
    """One chunk's logits over this rank's unpadded columns, in the head's dtype, then upcast (as the unfused path
    upcasts the head's output)."""
    return (hidden @ weight[:valid].t()).to(dtype)


class _FusedHeadLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int, group,
                chunk_tokens: int):
        rank, size = _tp_rank_size(group)
        local_vocab = weight.shape[0]
        vocab_start = rank * local_vocab
        valid = max(0, min(local_vocab, vocab_size - vocab_start))
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = labels.reshape(-1)
        n = flat.shape[0]
        dtype = _compute_dtype(hidden)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy, lse_all = torch.empty_like(logp), torch.empty_like(logp)
        for start in range(0, n, chunk_tokens):
            x = _chunk_logits(flat[start:start + chunk_tokens], weight, valid, dtype)
            chunk = slice(start, start + x.shape[0])
            logp[chunk], entropy[chunk], lse_all[chunk] = chunk_statistics(
                x, flat_labels[chunk] - vocab_start, valid, group, size)
        ctx.save_for_backward(hidden, weight, labels, lse_all, entropy)
        ctx.meta = (chunk_tokens, valid, vocab_start)
        return logp.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        hidden, weight, labels, lse_all, entropy = ctx.saved_tensors
        chunk_tokens, valid, vocab_start = ctx.meta
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = labels.reshape(-1)
        dtype = lse_all.dtype
        g_logp = grad_logp.reshape(-1).to(dtype) if grad_logp is not None else torch.zeros_like(lse_all)
        g_ent = grad_entropy.reshape(-1).to(dtype) if grad_entropy is not None else torch.zeros_like(lse_all)
        grad_hidden = torch.empty_like(flat)
        # The weight's gradient is summed over every chunk: kept in at least fp32 until the end.
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device)
        w = weight[:valid]
        for start in range(0, flat.shape[0], chunk_tokens):
            h = flat[start:start + chunk_tokens]
            chunk = slice(start, start + h.shape[0])
            g = chunk_logit_grad(_chunk_logits(h, weight, valid, dtype), flat_labels[chunk] - vocab_start, valid,
                                 lse_all[chunk], entropy[chunk], g_logp[chunk], g_ent[chunk])
            g = g.to(hidden.dtype)  # the logit gradient in the head's dtype, as the unfused layer receives it
            grad_hidden[chunk] = g @ w
            grad_weight[:valid].addmm_(g.t().to(grad_weight.dtype), h.to(grad_weight.dtype))
        return grad_hidden.view_as(hidden), grad_weight.to(weight.dtype), None, None, None, None


def fused_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                        tp_group: dist.ProcessGroup | None = None,
                        chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(labels) and entropies under logits = hidden @ weight.T, in fp32 (fp64 for fp64 inputs): `hidden` [..., H]
    is the head's input (already gathered over the sequence-parallel region), `weight` [V_local, H] this rank's vocab
    slice of the head; the other arguments are mpo.models.logprobs.vocab_parallel_logprobs's."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on leading dims")
    if weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"head weight {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    chunk_tokens = chunk_tokens or max(1, CHUNK_ELEMENTS // max(weight.shape[0], 1))
    return _FusedHeadLogProbEntropy.apply(hidden, weight, labels, vocab_size, tp_group, chunk_tokens)


def output_layer(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """The megatron output layer of a model chunk on the last pipeline stage (through DDP / Float16Module), or None."""
    from mpo.models.builder import unwrap

    gpt = unwrap(chunk)
    if not getattr(gpt, "post_process", False):
        return None
    config = getattr(gpt, "config", None)
    if getattr(config, "use_mup", False) or getattr(config, "mtp_num_layers", None):
        return None  # logits scaled after the layer, or used by MTP heads: not a plain head
    head = getattr(gpt, "output_layer", None)
    # A critic's value head (mpo.models.value_head) replaces the output layer: nothing to fuse there.
    if head is None or not hasattr(head, "gather_output") or head.gather_output or getattr(head, "bias", None) \
            is not None:
        return None
    return head


class DeferredHead:
    """The output layer in deferred mode: `weight` is what its last forward would have multiplied by (the FP32 head's
    upcast tied embedding, or the layer's own weight). Kept here, not on the layer: a Parameter set as a module
    attribute would become one of its parameters."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.weight: torch.Tensor | None = None

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        """Stands in for ColumnParallelLinear.forward: the input as its matmul would see it (the FP32 head's pre-hook
        has already upcast input and weight)."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)

        layer = self.layer
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                          group=layer.tp_group)
        else:
            hidden = copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)
        self.weight = weight if weight is not None else layer.weight
        return hidden, None


@contextlib.contextmanager
def deferred_head(chunks: list[torch.nn.Module]) -> Iterator[DeferredHead | None]:
    """Within the block, the last stage's output layer returns its (gathered) input: the model's output is the head's
    input [b, s, H] and the head's weight is the yielded DeferredHead's `weight` after each forward. Yields None where
    there is nothing to defer (not the last stage, a value head, MuP or MTP): the model then returns logits."""
    layer = output_layer(chunks[-1]) if chunks else None
    if layer is None:
        yield None
        return
    deferred = DeferredHead(layer)
    layer.forward = deferred.forward  # an instance attribute: __call__ (and the FP32 head's pre-hook) still run
    try:
        yield deferred
    finally:
        del layer.forward  # the class's forward again
