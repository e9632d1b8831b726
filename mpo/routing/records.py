"""Per-micro-batch routing records: what the router chose, in the trainer's [b, s] batch-major token layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mpo.rollout.protocol import route_dtype


def host_copy(t: Tensor | None) -> Tensor | None:
    """`t` in host memory, for routing state kept across a pass or a step: records and engine routes would otherwise
    hold 15-56 GiB of a GPU at 32k-token rows (Qwen3-30B-A3B, DeepSeek-V3). Where CUDA runs the host tensor is
    page-locked (its moves back to the GPU are asynchronous DMAs) and a device tensor's copy is made without waiting:
    call `host_copies_landed()` before reading it on the host. Without CUDA a host tensor is returned as it is."""
    if t is None:
        return t
    if t.device.type == "cpu":
        return t.pin_memory() if torch.cuda.is_available() and not t.is_pinned() else t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def host_copies_landed() -> None:
    """Wait for the device-to-host copies `host_copy` started on the current CUDA stream (no-op without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def index_dtype(num_experts: int) -> torch.dtype:
    """The torch dtype of captured expert ids 0..num_experts-1 (never -1: mpo.rollout.protocol.route_dtype)."""
    return getattr(torch, route_dtype(num_experts).name)


@dataclass
class MicroBatchRouting:
    """Routing of one micro-batch over a set of MoE layers (all of them, or one pipeline stage's).

    Attributes:
        layers: global 1-based layer numbers (megatron's ``TransformerLayer.layer_number``), ascending; axis 2 of
            every tensor follows this order.
        indices: ``[b, s, L, K]`` expert ids chosen for the token at input position s (capture: small unsigned dtype;
            replay input: any integer dtype, -1 = no record, route naturally).
        logp: ``[b, s, L, K]`` fp32 router log-softmax over all experts, gathered at ``indices`` (captures only).
        logp_at: ``[b, s, L, K]`` fp32 router log-softmax at an index set given to the capture (e.g. the old top-K),
            or None.
        natural: ``[b, s, L, K]`` the router's own top-K where replay forced ``indices`` (captures under R2/R3), or
            None when nothing was replayed (then ``indices`` are the router's own choice). Replay makes ``indices``
            equal the replayed routes by construction; agreement measured on ``natural`` is what can fail.
    """

    layers: tuple[int, ...]
    indices: Tensor
    logp: Tensor | None = None
    logp_at: Tensor | None = None
    natural: Tensor | None = None

    def __post_init__(self) -> None:
        if self.indices.dim() != 4 or self.indices.shape[2] != len(self.layers):
            raise ValueError(f"indices {tuple(self.indices.shape)} must be [b, s, L={len(self.layers)}, K]")

    @property
    def topk(self) -> int:
        return self.indices.shape[-1]

    def layer_slot(self, layer_number: int) -> int:
        try:
            return self.layers.index(layer_number)
        except ValueError:
            raise KeyError(f"no routing record for layer {layer_number}; have layers {self.layers}") from None

    def select(self, layers: tuple[int, ...] | list[int]) -> "MicroBatchRouting":
        """The same record restricted to (and ordered by) `layers`, e.g. one pipeline stage's layers."""
        slots = [self.layer_slot(layer) for layer in layers]
        pick = (lambda x: None if x is None else x[:, :, slots])  # noqa: E731
        return MicroBatchRouting(tuple(layers), self.indices[:, :, slots], pick(self.logp), pick(self.logp_at),
                                 pick(self.natural))

    def to_host(self) -> "MicroBatchRouting":
        """This record in host memory, page-locked where CUDA runs (see `host_copy`)."""
        return MicroBatchRouting(self.layers, host_copy(self.indices), host_copy(self.logp), host_copy(self.logp_at),
                                 host_copy(self.natural))

    def to(self, device: torch.device | str) -> "MicroBatchRouting":
        move = (lambda x: None if x is None else x.to(device))  # noqa: E731
        return MicroBatchRouting(self.layers, self.indices.to(device), move(self.logp), move(self.logp_at),
                                 move(self.natural))

    def rows(self, start: int, stop: int, width: int) -> "MicroBatchRouting":
        """Rows [start, stop) and their first `width` positions (one micro-batch's part of a joined one)."""
        part = (lambda x: None if x is None else x[start:stop, :width])  # noqa: E731
        return MicroBatchRouting(self.layers, part(self.indices), part(self.logp), part(self.logp_at),
                                 part(self.natural))

    @staticmethod
    def join(records: "list[MicroBatchRouting]", width: int) -> "MicroBatchRouting":
        """Replay inputs of several micro-batches as one (their rows in order), positions padded to `width` with -1
        (no record: routed naturally, as padding is)."""
        padded = [torch.nn.functional.pad(r.indices, (0, 0, 0, 0, 0, width - r.indices.shape[1]), value=-1)
                  for r in records]
        return MicroBatchRouting(records[0].layers, torch.cat(padded))

    def natural_choice(self) -> "MicroBatchRouting":
        """The router's own top-K as a record (``indices`` themselves when nothing was replayed)."""
        if self.natural is None:
            return self
        return MicroBatchRouting(self.layers, self.natural)

    def replayed_choice(self) -> "MicroBatchRouting":
        """The experts the forward actually used, without the natural record (for replay-vs-natural comparisons)."""
        return MicroBatchRouting(self.layers, self.indices)


def route_slots(num_route_layers: int, layers: tuple[int, ...], *, num_layers: int, first_k_dense: int) -> list[int]:
    """Indices into an engine routes array's layer axis of megatron layer numbers `layers`. The engine's array holds
    every layer (SGLang: engine layer l = layer number l+1) or the MoE layers only (after the first_k_dense)."""
    offset = 1 if num_route_layers == num_layers else 1 + first_k_dense
    if num_route_layers not in (num_layers, num_layers - first_k_dense):
        raise ValueError(f"engine routes have {num_route_layers} layers; the model has {num_layers} "
                         f"({num_layers - first_k_dense} MoE)")
    return [layer - offset for layer in layers]
