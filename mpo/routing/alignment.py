"""Token alignment between routing records, scored tokens and the rollout engine's routes.

Conventions (all batch-major ``[b, s, ...]``):

* A capture's position p holds the routing of the token at *input* position p (megatron's router sees tokens
  sequence-major ``[s*b]``; :mod:`mpo.routing.capture` transposes per micro-batch).
* Log-probs from :func:`mpo.models.forward.run_microbatches` put at position t the score of token t, computed from
  the logits at input position t-1. The routing "for token t" (RSPO) is therefore the decision at input position
  t-1: :func:`align_to_scored_tokens` shifts by one, and a packed sequence's first token (position_ids == 0) and
  position 0 get the fill value, exactly where the log-probs are 0.
* SGLang (>= 0.5.7, ``return_routed_experts``) returns per request ``int32 [n - 1 - start_len, L_all, K]`` for a
  sequence of n = prompt + completion tokens: row j is the routing of the token at input position ``start_len + j``
  when the engine processed it (prefill for prompt tokens, decode for generated ones). The final token was sampled
  but never fed back, so it has no row. L_all counts all hidden layers (mpo models are all-MoE, so engine layer l is
  megatron layer_number l+1). :func:`place_rollout_routes` writes these rows at their input positions of the training
  row (prompt + response, right-padded or packed) and fills everything else with -1 ("no record": replay routes
  those tokens naturally; they are the last token of each sequence, padding, and positions before start_len).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mpo.rollout.protocol import decode_routed_experts, encode_routed_experts, route_dtype
from mpo.routing.records import MicroBatchRouting


def align_to_scored_tokens(x: Tensor, position_ids: Tensor | None = None, fill: float = 0.0) -> Tensor:
    """``out[:, t] = x[:, t-1]`` (routing of the input that produced token t's logits); fill where nothing is scored.

    Args:
        x: ``[b, s, ...]`` per-input-position values (e.g. router log-probs ``[b, s, L, K]``).
        position_ids: ``[b, s]`` for packed rows (restart at 0 per sequence); their starts get ``fill``.
    """
    out = torch.cat([torch.full_like(x[:, :1], fill), x[:, :-1]], dim=1)
    if position_ids is not None:
        starts = (position_ids == 0).to(out.device)
        out = out.masked_fill(starts.view(*starts.shape, *([1] * (out.dim() - 2))), fill)
    return out


@dataclass
class RolloutRoutes:
    """Routes the inference engine returned for one sequence (SGLang's ``meta_info["routed_experts"]``, decoded).

    Attributes:
        routes: ``int32 [num_tokens - 1 - start_len, L_all, K]``.
        num_tokens: prompt + completion tokens of the sequence.
        start_len: SGLang's ``routed_experts_start_len`` (0: routes start at the first prompt token).
    """

    routes: Tensor
    num_tokens: int
    start_len: int = 0

    def __post_init__(self) -> None:
        expected = self.num_tokens - 1 - self.start_len
        if self.routes.dim() != 3 or self.routes.shape[0] != expected:
            raise ValueError(f"routed_experts {tuple(self.routes.shape)}: expected [{expected}, L, K] for "
                             f"{self.num_tokens} tokens and start_len {self.start_len}")


def decode_sglang_routed_experts(encoded: str, num_tokens: int, num_layers: int, topk: int,
                                 start_len: int = 0) -> RolloutRoutes:
    """SGLang's base64 little-endian int32 ``routed_experts`` string -> :class:`RolloutRoutes` (the wire format
    itself lives in mpo.rollout.protocol)."""
    flat = decode_routed_experts(encoded, rows=num_tokens - 1 - start_len, num_layers=num_layers, topk=topk)
    return RolloutRoutes(torch.from_numpy(flat), num_tokens, start_len)


def encode_sglang_routed_experts(routes: Tensor) -> str:
    """Inverse of :func:`decode_sglang_routed_experts` (for tests and stand-in engines)."""
    return encode_routed_experts(routes.to(torch.int32).numpy())


def place_rollout_routes(rows: list[list[RolloutRoutes]], seq_len: int,
                         layers: tuple[int, ...] | None = None) -> MicroBatchRouting:
    """Engine routes of a micro-batch -> replayable ``[b, s, L_all, K]`` indices (-1 where no record).

    Args:
        rows: per training row, the sequences packed into it in order (one sequence for right-padded rows); a
            sequence of n tokens occupies the next n positions.
        seq_len: s, the padded row length.
        layers: the layer numbers of the routes' layer axis (default 1..L: every layer the engine returned; a
            pipeline stage's own layers once cut by mpo.trainer.distribute).
    """
    first = next(seq for row in rows for seq in row)
    num_layers, topk = first.routes.shape[1:]
    largest = max((int(seq.routes.max()) for row in rows for seq in row if seq.routes.numel()), default=0)
    dtype = getattr(torch, route_dtype(largest + 1, signed=True).name)
    out = torch.full((len(rows), seq_len, num_layers, topk), -1, dtype=dtype)
    for b, row in enumerate(rows):
        offset = 0
        for seq in row:
            if offset + seq.num_tokens > seq_len:
                raise ValueError(f"row {b}: sequences need {offset + seq.num_tokens} positions, row has {seq_len}")
            start = offset + seq.start_len
            out[b, start:start + seq.routes.shape[0]] = seq.routes.to(dtype)
            offset += seq.num_tokens
    return MicroBatchRouting(tuple(range(1, num_layers + 1)) if layers is None else tuple(layers), out)


def routes_from_record(record: MicroBatchRouting, row: int, num_tokens: int, offset: int = 0) -> RolloutRoutes:
    """A captured row in the engine's format (what SGLang would return for it): positions 0..n-2, all layers."""
    if record.layers != tuple(range(1, len(record.layers) + 1)):
        raise ValueError(f"need all layers 1..L, have {record.layers}")
    routes = record.indices[row, offset:offset + num_tokens - 1].to(torch.int32)
    return RolloutRoutes(routes, num_tokens)
