"""Run the model over micro-batches with megatron-core's schedules (1F1B under PP) and score tokens.

This is the one path every forward of the trainer takes: old log-probs, reference log-probs and the policy update.
On the last pipeline stage each micro-batch's vocab-parallel logits become per-token log-probs and entropies; an
optional `loss_fn` turns those into a loss that megatron back-propagates through all stages.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch

from mpo.models.context_parallel import gather_from_context_parallel, gather_with_grad, split_for_context_parallel
from mpo.models.fused_head import deferred_head
from mpo.models.logprobs import DEFAULT_CHUNK_TOKENS, next_token_logprobs, sequence_logprobs, token_scores
from mpo.models.packed import PackedLayout


@dataclass
class MicroBatch:
    """One micro-batch of right-padded (or packed) token rows.

    Attributes:
        input_ids: [b, s] token ids.
        position_ids: [b, s]; restart at 0 for each packed sequence. Default: 0..s-1 per row.
        extras: anything the loss function needs (masks, advantages, old log-probs, ...), passed through untouched.
        packing: for a packed row ([1, s], mpo.models.packed): where its sequences sit. Then `extras` hold the
            per-token tensors in the sample layout [n, L] and the log-probs, entropies and values handed to the loss
            and returned are in that layout too; None: right-padded rows, one sample per row.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)
    packing: PackedLayout | None = None

    def to(self, device: torch.device | str) -> "MicroBatch":
        """This micro-batch with its ids, positions and every tensor in `extras` on `device` (other extras as they
        are): the one place a batch built on the host moves to the compute device."""
        move = lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return MicroBatch(move(self.input_ids), move(self.position_ids), {k: move(v) for k, v in self.extras.items()},
                          self.packing.to(device) if self.packing is not None else None)

    def model_layout(self, x: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the sample layout (extras) in the layout the model and its routing records see."""
        return x if self.packing is None else self.packing.pack(x)

    def positions(self) -> torch.Tensor:
        if self.position_ids is not None:
            return self.position_ids
        b, s = self.input_ids.shape
        return torch.arange(s, device=self.input_ids.device).expand(b, s)


def join_rows(microbatches: list[MicroBatch], max_rows: int) -> list[list[int]]:
    """Consecutive right-padded micro-batches grouped for one forward each: groups of at most `max_rows` rows (a
    micro-batch larger than that is a group of its own). Returns each group's micro-batch indices."""
    groups: list[list[int]] = []
    rows = 0
    for i, mb in enumerate(microbatches):
        b = mb.input_ids.shape[0]
        if groups and rows + b <= max_rows:
            groups[-1].append(i)
            rows += b
        else:
            groups.append([i])
            rows = b
    return groups


def joined(microbatches: list[MicroBatch]) -> MicroBatch:
    """One micro-batch of the rows of right-padded `microbatches`, as wide as the widest (token 0 after each row's
    end, as rank_microbatches pads): a forward of it gives each row what the row's own micro-batch gives (causal
    attention: a row's positions never see the padding after them). No extras: for forward-only passes."""
    width = max(mb.input_ids.shape[1] for mb in microbatches)
    ids = torch.cat([torch.nn.functional.pad(mb.input_ids, (0, width - mb.input_ids.shape[1]))
                     for mb in microbatches])
    return MicroBatch(ids)


# loss_fn(micro_batch, logprobs [b,s], entropy [b,s]) -> (scalar loss, dict of detached metrics)
LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def run_microbatches(model: torch.nn.Module, microbatches: list[MicroBatch], *, vocab_size: int,
                     loss_fn: LossFn | None = None, forward_only: bool | None = None, keep_logits: bool = False,
                     chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, values: bool = False,
                     fused_head: bool = True) -> list[dict]:
    """Forward (and backward, if `loss_fn` is given and not forward_only) over all micro-batches.

    Returns, on the last pipeline stage, one dict per micro-batch with "logprobs" and "entropy" ([b, s], fp32,
    detached; position t scores token t), "logits" (this rank's vocab slice) when keep_logits, and the loss_fn's
    metrics. The LM head runs fused with the scoring (mpo.models.fused_head: no [tokens, vocab] logits on the
    training path) unless `keep_logits` asks for the logits whole (parity tests, debug dumps) or `fused_head` is off.
    Other stages return an empty list. With `values` (a critic, mpo.models.value_head) the dict holds
    "values" ([b, s], aligned like the log-probs) and loss_fn is called as ``loss_fn(mb, values, None)``.

    Loss scaling: megatron divides each micro-batch loss by the number of micro-batches (and multiplies it by the
    context-parallel size), and its DDP divides reduced gradients by the data x context parallel size. mpo's losses
    are already normalised by global mini-batch denominators, so the runner cancels all three: the gradient is
    exactly the sum over micro-batches and data-parallel ranks of d(loss)/d(params) (under CP every CP rank computes
    the whole row's loss and back-propagates its own positions' share, which DDP sums).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        return []
    from mpo.models.chunks import as_chunks

    chunks = as_chunks(model)
    # megatron's interleaved (VPP) schedule runs micro-batches in groups of PP: fill the last group with copies of the
    # last micro-batch that contribute no loss and no output (the trainer's passes arrive padded already, with
    # loss-free rows, see mpo.trainer.rows; this covers one-off forwards such as weight-sync probes).
    padding = -len(microbatches) % parallel_state.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 0
    real_microbatches = len(microbatches)
    if padding:
        filler = MicroBatch(microbatches[-1].input_ids, microbatches[-1].position_ids,
                            {**microbatches[-1].extras, "_vpp_padding": True}, microbatches[-1].packing)
        microbatches = list(microbatches) + [filler] * padding
    forward_only = loss_fn is None if forward_only is None else forward_only
    num_microbatches = len(microbatches)
    from mpo.models.ddp import is_ddp

    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group, cp = parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    undo_scaling = num_microbatches
    if is_ddp(model):
        undo_scaling *= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    # megatron also multiplies each loss by the CP size (its CP ranks each hold a share of the loss, averaged by DDP
    # over DP x CP); here every CP rank computes the whole row's loss (context_parallel_scores), so cancel that too
    undo_scaling /= cp
    batch_size, seq_length = microbatches[0].input_ids.shape

    def scaled_loss(mb: MicroBatch, out: dict, scored: torch.Tensor, entropy: torch.Tensor | None):
        """loss_fn(mb, scored, entropy), its metrics into `out`; a graph-connected zero without a loss (forward only,
        or a VPP filler micro-batch)."""
        if loss_fn is None or mb.extras.get("_vpp_padding"):
            loss = (scored.sum() if entropy is None else scored.sum() + entropy.sum()) * 0.0
        else:
            loss, metrics = loss_fn(mb, scored, entropy)
            out.update(metrics)
            out["loss"] = loss.detach()
        return loss * undo_scaling, out

    def value_loss_func(mb: MicroBatch, output: torch.Tensor):
        from mpo.models.value_head import scored_values

        if cp > 1:  # this rank's chunks -> the whole row, on every CP rank (mpo.models.context_parallel)
            output = gather_with_grad(output, cp_group)
        scored = scored_values(output)
        if mb.packing is not None:  # a sequence's first value would read the previous sequence's last token
            scored = mb.packing.unpack(scored.masked_fill(mb.position_ids == 0, 0.0))
        return scaled_loss(mb, {"values": scored.detach()}, scored, None)

    def loss_func(mb: MicroBatch, head_weight: torch.Tensor | None, output: torch.Tensor):
        """`output`: this rank's vocab slice of the logits, or with `head_weight` the LM head's input."""
        if cp > 1:
            logprobs, entropy = context_parallel_scores(mb, head_weight, output)
        else:
            logprobs, entropy = sequence_logprobs(output, mb.input_ids, vocab_size=vocab_size, tp_group=tp_group,
                                                  position_ids=mb.position_ids, chunk_tokens=chunk_tokens,
                                                  head_weight=head_weight)
        if mb.packing is not None:
            logprobs, entropy = mb.packing.unpack(logprobs), mb.packing.unpack(entropy)
        out = {"logprobs": logprobs.detach(), "entropy": entropy.detach()}
        if keep_logits:
            out["logits"] = output.detach() if cp == 1 else gather_from_context_parallel(output.detach(), cp_group)
        return scaled_loss(mb, out, logprobs, entropy)

    def context_parallel_scores(mb: MicroBatch, head_weight: torch.Tensor | None, output: torch.Tensor):
        """Context parallelism: this rank scores the next token at its own positions (the labels shifted over the
        whole row, so a chunk's last label comes from the next chunk), then every CP rank gathers the whole row's
        scores and computes the same loss of it (gradients flow back to each rank's own positions)."""
        labels = split_for_context_parallel(torch.nn.functional.pad(mb.input_ids[:, 1:], (0, 1)), cp_rank, cp)
        next_logp, next_entropy = next_token_logprobs(output, labels, vocab_size=vocab_size, tp_group=tp_group,
                                                      chunk_tokens=chunk_tokens, head_weight=head_weight)
        next_logp, next_entropy = gather_with_grad(next_logp, cp_group), gather_with_grad(next_entropy, cp_group)
        return token_scores(next_logp, next_entropy, mb.positions())

    def forward_step(data_iterator: Iterator[MicroBatch], model_chunk: torch.nn.Module):
        mb = next(data_iterator)
        attention = mb.packing.forward_kwargs(mb.input_ids.device) if mb.packing is not None else {}
        ids, positions = mb.input_ids, mb.positions()
        if cp > 1:  # megatron's split: this rank's 2 of 2 x CP chunks; a packed row's mask stays whole (global)
            if attention.get("packed_seq_params") is not None:
                raise ValueError("context parallelism with packed rows in Transformer Engine's THD format is not "
                                 "supported yet; the local spec packs with an attention mask")
            ids, positions = (split_for_context_parallel(x, cp_rank, cp) for x in (ids, positions))
        output = model_chunk(ids, positions, attention.pop("attention_mask", None), **attention)
        if values:
            return output, partial(value_loss_func, mb)
        # the deferred head noted the weight its forward would have used (the FP32 head's upcast tied embedding)
        weight = head.weight if head is not None and model_chunk is chunks[-1] else None
        return output, partial(loss_func, mb, weight)

    # megatron's schedules record autograd graphs even when forward_only: a pass with no backward (old log-probs,
    # reference, values, router-shift probes) would hold a training forward's activations per micro-batch.
    fuse = fused_head and not keep_logits and not values
    with torch.no_grad() if forward_only else contextlib.nullcontext(), \
            deferred_head(chunks) if fuse else contextlib.nullcontext() as head:
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            # the interleaved schedule reads one iterator per chunk: each chunk sees every micro-batch once
            data_iterator=[iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches),
            model=chunks,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=batch_size,
            forward_only=forward_only,
        )
    return list(outputs)[:real_microbatches] if parallel_state.is_pipeline_last_stage() else []
