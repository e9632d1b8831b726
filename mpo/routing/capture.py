"""Record and replay megatron-core's MoE top-k routing per micro-batch, without forking megatron.

How it hooks in (megatron-core 0.19.2):

* ``megatron/core/transformer/moe/moe_utils.py:topk_routing_with_score_function`` asks ``router_replay.get_replay_topk
  (scores, topk, num_groups, group_topk, default_compute_topk)`` for the top-k whenever the router's ``router_replay``
  attribute is set (``TopKRouter.routing`` passes ``router_replay=self.router_replay``). That is the slot megatron's own
  ``RouterReplay`` (``router_replay.py``) occupies. We put a :class:`_RouterTap` there, per router instance, with the
  same protocol: it returns megatron's own top-k (recording it) or the replayed indices with the *current* scores
  gathered at them, so gate weights are recomputed and the router keeps its gradient. Using the slot directly (instead
  of ``RouterReplay``'s process-global instance list and global action) lets several models live in one process and
  lets the record follow the micro-batch inside megatron's schedules.
* ``TopKRouter.routing(logits, padding_mask)`` is wrapped on each instance only to see the raw router logits
  (``[s, b, E]``, sequence-major; the local token shard under sequence parallelism) for the log-softmax record.
* A forward pre-hook on the GPTModel counts micro-batches: megatron's schedules call each stage's model chunk once per
  micro-batch, in micro-batch order (1F1B included), and activation recompute re-runs layers, never the GPTModel.
  Under virtual pipeline stages (mpo.models.chunks) each chunk counts its own micro-batches: the interleaved schedule
  runs chunk 0 ahead of chunk 1, each in micro-batch order. Layer numbers are megatron's global ones (its layer
  offset covers uneven and virtual stages), so records of any layout line up by layer id.

Natural choice under replay: when a session replays routes, the tap also computes the router's own top-k from the
same scores (one extra top-k per layer, no gradient) and records it as ``MicroBatchRouting.natural``. The replayed
``indices`` equal the replay input by construction, so agreement between engine and trainer, or between the old and
the update forward, is measured on the natural choice; replayed vs natural is the fraction replay forced.

Activation recompute: the recomputed forward runs inside autograd's backward (``torch._C._current_graph_task_id() !=
-1``). It neither records nor consumes replay records; it pops, per layer, the indices the original forward used
(FIFO: backward visits micro-batches in forward order), so the recomputed activations match the saved ones exactly.

Fused routing (``moe_router_fusion=True``) calls Transformer Engine's fused kernel and never reaches the slot; attaching
refuses such models, and each session asserts that every local router ran through the tap once per micro-batch.
Context parallelism (megatron's split of each row into 2 x CP chunks): replay reads each CP rank's chunks of the whole-row
records; captures are gathered over CP back into whole rows (as over TP under sequence parallelism).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import Tensor

from mpo.models.context_parallel import chunk_positions, gather_from_context_parallel
from mpo.routing.records import MicroBatchRouting, host_copies_landed, host_copy, index_dtype


@dataclass(frozen=True)
class CaptureConfig:
    """What a routing session records.

    Attributes:
        record: keep each router's top-k indices per token (needed for R2 and the metrics).
        record_logprobs: also keep the router's log-softmax over all experts at the chosen indices (RSPO's old side).
        gather_sequence_parallel: under sequence parallelism each TP rank's router sees only its sequence shard;
            all-gather the records over TP so every rank holds the full micro-batch (costs one small all-gather per
            micro-batch and layer at the end of the session). If False, each TP rank keeps its shard ``[b, s/tp]``.
    """

    record: bool = True
    record_logprobs: bool = True
    gather_sequence_parallel: bool = True


def _tap_for(router) -> "_RouterTap | None":
    tap = getattr(router, "router_replay", None)
    return tap if isinstance(tap, _RouterTap) else None


class _RouterTap:
    """Occupies ``TopKRouter.router_replay`` (megatron's replay slot) for one MoE layer."""

    def __init__(self, hooks: "RoutingHooks", router, chunk: int = 0) -> None:
        self.hooks = hooks
        self.router = router
        self.chunk = chunk  # the virtual-pipeline chunk the router's layer lives in
        self.layer_number: int = int(router.layer_number)  # set by TransformerLayer, global and 1-based
        self.logits: Tensor | None = None  # [tokens, E] of the current routing call
        self.local_seq_batch: tuple[int, int] = (0, 0)
        self.backward_fifo: deque[Tensor] = deque()

    # --- the protocol of megatron's RouterReplay.get_replay_topk -------------------------------------------------
    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[Tensor, Tensor]:
        session = self.hooks.session_state
        if session is None:
            return default_compute_topk(scores, topk, num_groups, group_topk)
        if torch._C._current_graph_task_id() != -1:
            # Activation recompute inside backward: reuse exactly what the original forward used.
            if not self.backward_fifo:
                raise RuntimeError(f"routing: layer {self.layer_number} recomputed without a saved routing "
                                   "(was the session opened with backward=True?)")
            idx = self.backward_fifo.popleft()
            return scores.gather(1, idx), idx
        return session.route(self, scores, topk, num_groups, group_topk, default_compute_topk)


class _Session:
    """State of one pass over the micro-batches (one call of megatron's forward_backward_func)."""

    def __init__(self, hooks: "RoutingHooks", config: CaptureConfig, replay: Sequence[MicroBatchRouting] | None,
                 gather_at: Sequence[MicroBatchRouting] | None, backward: bool) -> None:
        self.hooks = hooks
        self.config = config
        self.replay = replay
        self.gather_at = gather_at
        self.save_for_recompute = backward and hooks.recompute
        self.microbatch = -1  # of the tap being routed (set from `seen` per chunk)
        self.seen = [-1] * len(hooks.chunks)  # last micro-batch each model chunk started
        self.shapes: list[tuple[int, ...]] = []  # [b, s] of each micro-batch
        self.calls: dict[tuple[int, int], int] = {}  # (micro-batch, layer) -> routing calls outside recompute
        # (micro-batch, layer) -> raw capture: indices [tokens, K], optional logp, logp_at and natural, (s_local, b)
        self.raw: dict[tuple[int, int], tuple[Tensor, Tensor | None, Tensor | None, Tensor | None,
                                              tuple[int, int]]] = {}

    def _local_tokens(self, kind: str, source: Sequence[MicroBatchRouting], layer: int,
                      s_local: int, b: int) -> Tensor:
        """The record for this micro-batch and layer as megatron's local token layout [s_local*b, K] int64, made when
        the router asks (once per micro-batch and layer) and not kept: it lives as long as the routing call, or until
        the micro-batch's backward where autograd saves it (the gather at the replayed experts, the recompute FIFO).
        The pass's records stay in their compact dtype; at 30B scale an int64 copy of every micro-batch's indices
        would be ~10 GB during the old-logprob pass."""
        if self.microbatch >= len(source):
            raise RuntimeError(f"routing: {kind} has {len(source)} micro-batches, forward {self.microbatch} asked")
        rec = source[self.microbatch]
        per_layer = rec.indices[:, :, rec.layer_slot(layer)]  # [b, s, K]
        if self.hooks.cp_size > 1:  # this CP rank's chunks of the whole row, in the order its tokens run
            per_layer = per_layer.index_select(1, chunk_positions(per_layer.shape[1], self.hooks.cp_rank,
                                                                  self.hooks.cp_size))
        if per_layer.shape[0] != b:
            raise ValueError(f"routing: {kind} record has batch {per_layer.shape[0]}, router sees {b}")
        start = self.hooks.sequence_shard_start(s_local)
        if per_layer.shape[1] < start + s_local:
            raise ValueError(f"routing: {kind} record has {per_layer.shape[1]} positions, router needs "
                             f"{start + s_local}")
        local = per_layer[:, start:start + s_local].transpose(0, 1).reshape(s_local * b, -1)
        return local.to(device=self.hooks.device, dtype=torch.int64)

    @property
    def num_microbatches(self) -> int:
        return max(self.seen) + 1

    def route(self, tap: _RouterTap, scores: Tensor, topk: int, num_groups, group_topk,
              default_compute_topk) -> tuple[Tensor, Tensor]:
        self.microbatch = self.seen[tap.chunk]
        key = (self.microbatch, tap.layer_number)
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.calls[key] > 1:
            raise RuntimeError(f"routing: layer {tap.layer_number} routed twice in micro-batch {self.microbatch}")
        s_local, b = tap.local_seq_batch
        natural = None
        if self.replay is not None:
            forced = self._local_tokens("replay", self.replay, tap.layer_number, s_local, b)
            # The router's own choice, computed next to the replayed one: positions without a record (e.g. the last
            # token under R3) route by it, and the capture keeps it so agreement metrics measure something.
            with torch.no_grad():
                _, natural = default_compute_topk(scores.detach(), topk, num_groups, group_topk)
            idx = torch.where(forced < 0, natural, forced)
            probs = scores.gather(1, idx)  # current scores at the replayed experts: gradients reach the router
        else:
            probs, idx = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.save_for_recompute:
            tap.backward_fifo.append(idx)
        if self.config.record:
            self._capture(tap, idx, natural, s_local, b)
        return probs, idx

    def _capture(self, tap: _RouterTap, idx: Tensor, natural: Tensor | None, s_local: int, b: int) -> None:
        logp = logp_at = None
        record_logprobs = self.config.record_logprobs and self.hooks.router_logprobs
        gather_at = self.gather_at if self.hooks.router_logprobs else None
        if record_logprobs or gather_at is not None:
            with torch.no_grad():
                log_probs = torch.log_softmax(tap.logits.detach().float(), dim=-1)
                if record_logprobs:
                    logp = log_probs.gather(1, idx)
                if gather_at is not None:
                    at = self._local_tokens("gather_at", gather_at, tap.layer_number, s_local, b)
                    logp_at = log_probs.gather(1, at.clamp(min=0))
        small = idx.detach().to(self.hooks.index_dtype)
        natural_small = None if natural is None else natural.to(self.hooks.index_dtype)
        # Kept for the pass, so kept on the host: the device holds one routing call's tensors at a time.
        self.raw[(self.microbatch, tap.layer_number)] = (host_copy(small), host_copy(logp), host_copy(logp_at),
                                                         host_copy(natural_small), (s_local, b))


class RoutingHooks:
    """Routing capture and replay attached to one model (one pipeline stage's chunk).

    Use :meth:`session` around each pass of ``run_microbatches``; records come back per micro-batch in batch-major
    ``[b, s, L_local, K]`` layout keyed by global layer numbers.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter

        from mpo.models.builder import unwrap
        from mpo.models.chunks import as_chunks

        gpt = unwrap(model)
        self.chunks = as_chunks(gpt)
        config = gpt.config
        if config.moe_router_fusion:
            raise ValueError("routing: moe_router_fusion=True bypasses megatron's replay slot; disable it")
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.cp_group = parallel_state.get_context_parallel_group()
        self.recompute = config.recompute_granularity == "full"
        self.topk = config.moe_router_topk
        self.index_dtype = index_dtype(config.num_moe_experts)
        self.device = next(gpt.parameters()).device
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp_size > 1
        self.session_state: _Session | None = None
        # False: no session computes the router's log-softmax (records' logp and logp_at stay None, gather_at is not
        # read): a trainer whose loss reads no router log-probs (only RSPO / +rs do) keeps no fp32 [b, s, L, K]
        # per micro-batch.
        self.router_logprobs = True
        self.taps: list[_RouterTap] = []
        for chunk_index, chunk in enumerate(self.chunks):
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if _tap_for(module) is not None:
                        raise ValueError("routing: model already has RoutingHooks attached")
                    tap = _RouterTap(self, module, chunk_index)
                    module.router_replay = tap
                    module.routing = self._wrap_routing(module, tap)
                    self.taps.append(tap)
        # A stage may hold no MoE layer (DeepSeek-V3's dense first layers alone on an uneven first stage): it records
        # empty [b, s, 0, K] routings, so the metrics' pipeline collectives still run on every stage.
        self.taps.sort(key=lambda t: t.layer_number)
        self.layers: tuple[int, ...] = tuple(t.layer_number for t in self.taps)
        self._pre_hooks = [chunk.register_forward_pre_hook(self._counter(k)) for k, chunk in enumerate(self.chunks)]

    @staticmethod
    def _wrap_routing(router, tap: _RouterTap):
        original = router.routing  # bound method of the instance

        def routing(logits: Tensor, padding_mask: Tensor | None = None):
            tap.local_seq_batch = (logits.shape[0], logits.shape[1])
            tap.logits = logits.view(-1, logits.shape[-1])
            try:
                return original(logits, padding_mask=padding_mask)
            finally:
                tap.logits = None  # do not keep the activation alive past the call

        return routing

    def _counter(self, chunk: int):
        def next_microbatch(module, args) -> None:
            if self.session_state is not None:
                self.session_state.seen[chunk] += 1
                if chunk == 0 and args:  # input_ids [b, s]: the shape of a stage's empty records
                    self.session_state.shapes.append(tuple(args[0].shape))
        return next_microbatch

    def sequence_shard_start(self, s_local: int) -> int:
        """First sequence position of this TP rank's shard (megatron splits [s, b, h] along s under SP)."""
        return self.tp_rank * s_local if self.sequence_parallel else 0

    def detach(self) -> None:
        """Remove the hooks (routers route naturally again)."""
        for tap in self.taps:
            tap.router.router_replay = None
            del tap.router.routing  # drop the instance attribute; the class method is visible again
        for hook in self._pre_hooks:
            hook.remove()
        self.taps = []

    @contextmanager
    def session(self, *, replay: Sequence[MicroBatchRouting] | None = None,
                gather_at: Sequence[MicroBatchRouting] | None = None, backward: bool = False,
                config: CaptureConfig = CaptureConfig()) -> Iterator["SessionResult"]:
        """Capture (and optionally replay) routing for one pass over micro-batches.

        Args:
            replay: per micro-batch, indices to force (R2: the old forward's capture; R3: the rollout engine's
                routes). Must cover every local MoE layer; -1 entries route naturally. Each (micro-batch, layer)
                record is consumed exactly once; the session asserts it on exit.
            gather_at: per micro-batch, an index set at which to also record the router's log-softmax (RSPO: the
                old top-K under the current router).
            backward: a backward follows this forward (training). With activation recompute the routing of each
                checkpointed layer is saved for its recompute and must all be used by the end of the session.
        """
        if self.session_state is not None:
            raise RuntimeError("routing: sessions do not nest")
        for tap in self.taps:
            tap.backward_fifo.clear()
        state = _Session(self, config, replay, gather_at, backward)
        result = SessionResult(self)
        self.session_state = state
        try:
            yield result
        finally:
            self.session_state = None
        self._check_consumed(state)  # only after a pass that did not raise
        result.records = self._finalize(state)

    def _check_consumed(self, state: _Session) -> None:
        n = state.num_microbatches
        if any(seen + 1 != n for seen in state.seen):
            raise RuntimeError(f"routing: model chunks ran {[seen + 1 for seen in state.seen]} micro-batches")
        expected = {(mb, layer) for mb in range(n) for layer in self.layers}
        missing = expected - set(state.calls)
        if missing:
            raise RuntimeError(f"routing: {len(missing)} (micro-batch, layer) routings never reached the tap, e.g. "
                               f"{sorted(missing)[:3]} (fused router path?)")
        if state.replay is not None and len(state.replay) != n:
            raise RuntimeError(f"routing: {len(state.replay)} replay records for {n} micro-batch forwards")
        if state.save_for_recompute:
            left = {t.layer_number: len(t.backward_fifo) for t in self.taps if t.backward_fifo}
            if left:
                raise RuntimeError(f"routing: routings saved for recompute were never used: {left}")

    def _finalize(self, state: _Session) -> list[MicroBatchRouting]:
        """Raw sequence-major captures -> batch-major MicroBatchRouting per micro-batch (gathered over TP under SP and
        over CP)."""
        if not state.config.record:
            return []
        host_copies_landed()  # the captures' device-to-host copies (mpo.routing.records.host_copy)
        out = []
        if not self.layers:
            for b, s in state.shapes:
                empty = torch.empty((b, s, 0, self.topk), dtype=self.index_dtype)
                logp = empty.float() if state.config.record_logprobs and self.router_logprobs else None
                at = empty.float() if state.gather_at is not None and self.router_logprobs else None
                out.append(MicroBatchRouting((), empty, logp, at, empty if state.replay is not None else None))
            return out
        for mb in range(state.num_microbatches):
            parts = [state.raw[(mb, layer)] for layer in self.layers]
            (s_local, b) = parts[0][4]

            def stack(i: int) -> Tensor | None:
                xs = [p[i] for p in parts]
                if any(x is None for x in xs):
                    return None
                x = torch.stack(xs, dim=1).view(s_local, b, len(self.layers), -1).transpose(0, 1)
                return self._gather_sequence(x.contiguous(), state.config)

            out.append(MicroBatchRouting(self.layers, stack(0), stack(1), stack(2), stack(3)))
        host_copies_landed()  # the gathered records' copies back to the host
        return out

    def _gather_sequence(self, x: Tensor, config: CaptureConfig) -> Tensor:
        """One micro-batch's record [b, s_local, L, K] -> whole rows: all-gathered over TP under sequence parallelism,
        then over CP (each rank's 2 of 2 x CP chunks back at their positions). Through the compute device (NCCL
        gathers device tensors), back to the host once."""
        if not config.gather_sequence_parallel or not (self.sequence_parallel or self.cp_size > 1):
            return x
        wire = x.to(self.device, torch.int32 if not x.is_floating_point() else x.dtype)  # gloo: no uint8 everywhere
        if self.sequence_parallel:
            parts = [torch.empty_like(wire) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, wire, group=self.tp_group)
            wire = torch.cat(parts, dim=1)
        if self.cp_size > 1:
            wire = gather_from_context_parallel(wire, self.cp_group)
        return host_copy(wire.to(x.dtype))


@dataclass(eq=False)  # a handle: hashed and compared by identity
class SessionResult:
    """Filled when the session exits: ``records[i]`` is micro-batch i's :class:`MicroBatchRouting`."""

    hooks: RoutingHooks
    records: list[MicroBatchRouting] = field(default_factory=list)


def attach_routing_hooks(model: torch.nn.Module) -> RoutingHooks:
    """Install routing capture/replay on every TopKRouter of `model` (DDP / Float16Module wrappers are fine)."""
    return RoutingHooks(model)
