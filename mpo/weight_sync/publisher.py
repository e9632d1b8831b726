"""The publisher (see mpo.weight_sync): on every rank, streams the weights to the engines after each step."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from mpo.parallel.collectives import all_reduce_, one_rank
from mpo.weight_sync.fp8 import dequantize_block, is_quantized, quantize_block, scale_name, to_engine_format
from mpo.weight_sync.gather import WeightStreamer
from mpo.weight_sync.relay import RELAY_TIMEOUT_S, NodeRelay, engines_on_this_node, plan_routes, relay_group
from mpo.weight_sync.transports import WeightSync, engine_set_sync, per_node_sync, transport_class
from mpo.weight_sync.verify import (ProbeCoverage, check_probe, combine_digests, covering_probe_runs, probe_bounds,
                                    tensor_digest, verify_checksum)

if TYPE_CHECKING:
    from mpo.config import ModelSection, RolloutSection, SyncSection

log = logging.getLogger(__name__)
PROBE_TOKENS = 16  # length of the first probe sequence SGLang engines are verified with (then extended to coverage)


class Publisher:
    """One rank's side of every weight sync of a run (collective: every rank of the trainer world makes one) for
    `model` (the unwrapped GPTModel chunk of pipeline `stage`, gathered on `device`), as the run's `rollout`, `sync` and
    `model_section` say; `pause`: engines may be generating during a sync (the off-policy modes); `seed`: the probe's.
    `score_probes` is collective: the trainer's log-probs of probe sequences, on every rank (SGLang verification; small
    objects travel on `object_group`). `engines`: rank 0's EngineSet, None on every other rank."""

    def __init__(self, rollout: RolloutSection, sync: SyncSection, model_section: ModelSection, model_cfg,
                 model: torch.nn.Module, *, pause: bool, seed: int, stage: int, device: torch.device, object_group,
                 score_probes: Callable[[list[list[int]]], list[list[float]]], engines=None) -> None:
        from mpo.config import served_dtype
        from mpo.models.hf_mapping import mapping_for

        self.rollout, self.sync, self.model_section = rollout, sync, model_section
        self.pause, self.seed = pause, seed
        self.engine_dtype = served_dtype(model_section, rollout)  # what the engines hold: bf16 or fp32
        self.model_cfg, self.engines, self.model = model_cfg, engines, model
        self.object_group, self.score_probes = object_group, score_probes
        self.streamer = WeightStreamer(model, mapping_for(model_cfg, spec="local"), stage=stage,
                                       bucket_bytes=sync.bucket_bytes, device=device,
                                       host_shared_memory=sync.host_shared_memory)
        # This rank's weight-update session (transports.WeightSync: engine_session, _sender_sync); close() ends it.
        self._sync = None
        self._membership = 0  # the EngineSet's membership rank 0's session was formed for
        self._urls: tuple = ()
        self.probes: list[list[int]] = []  # SGLang verification probe, grown until it covers every expert
        self.version: int | None = None  # the version last published
        # per-node routing (mpo.weight_sync.relay): every rank's engines on its node, for the URLs in _claims_key
        self._claims: list[list[int]] = []
        self._claims_key: tuple = ()
        self._relay_group = None  # made once, on the first sync that relays
        self.relayed = 0  # buckets this rank pushed for other nodes' senders in the current sync

    def _routes(self, info: dict):
        """Per-node routes of this sync (collective), or None unless the run routes per node
        (transports.per_node_sync: a same-host transport, the launcher's MPO_NODE_HOST) on several ranks."""
        if one_rank() or not per_node_sync(info["transport"], info["engine"]):
            return None
        key = tuple(info["urls"])
        if self._claims_key != key:  # engines moved (a restart on a new port): ask every rank again
            claims: list = [None] * dist.get_world_size()
            dist.all_gather_object(claims, engines_on_this_node(info["urls"]))
            self._claims, self._claims_key = claims, key
        return plan_routes(self._claims, self.streamer.senders, len(info["urls"]))

    def _relay(self, routes, rank: int, sync, version: int, info: dict):
        """This rank's NodeRelay for one sync (collective: the relay group is made on first use)."""
        device = self.streamer.device
        if self._relay_group is None:
            self._relay_group = relay_group(RELAY_TIMEOUT_S, "gloo" if device.type == "cpu" else "nccl")
        mine = self._claims[rank]
        direct = ((lambda named: sync.push_bucket(named, version, wait=False))
                  if sync is not None and mine and self.streamer.is_sender else None)
        lead = sync is not None and rank in routes.node_of_engine
        return NodeRelay(routes, rank=rank, buckets_of=dict(Counter(b.sender for b in self.streamer.buckets)),
                         group=self._relay_group, device=device,
                         direct=direct, leader_push=(lambda named: sync.push_bucket(named, version)) if lead else None,
                         shared=device.type == "cpu" and transport_class(info["transport"]).in_place)

    def publish(self, version: int) -> dict[str, float]:
        """Collective: stream the weights of `version` to every engine bucket by bucket and verify them
        (mpo.weight_sync says how, and what becomes of an engine that died during the stream). Returns the sync
        metrics."""
        engines, self.version = self.engines, version
        for _ in range(2):
            with engines.updating() if engines is not None else contextlib.nullcontext():
                metrics = self._stream(version)
                if engines is not None and self._sync is not None:
                    engines.drop_lost(self._sync.lost)  # engines given by URL that failed in it leave the run
            again = [engines is not None and bool(engines.stale)]
            if not one_rank():
                dist.broadcast_object_list(again, src=0)
            if not again[0]:
                break
        if engines is not None:  # engines given by URL that stopped answering are dropped (EngineSet.check_external)
            metrics["engines_live"] = float(len(engines.clients))
        if self.rollout.engine == "sglang":
            metrics.update(self.verify_by_probe())
        return metrics

    def engine_session(self):
        """Rank 0's weight-update session with its EngineSet (transports.WeightSync), made on first use and kept
        until close(): its transport is the resolved sync.transport ("auto" decided here)."""
        if self._sync is not None and self._membership != self.engines.membership:
            self.close()  # engines given by URL were dropped or re-admitted: a session for those in the run now
        if self._sync is None:
            self._sync = engine_set_sync(self.engines, self.sync)
            self._membership = self.engines.membership
        return self._sync

    def _sender_sync(self, info: dict):
        """This sender's WeightSync: rank 0 makes one for its EngineSet once (`info` unread); other senders make theirs
        for the engines rank 0 named (remade when the URLs change, e.g. after a local engine restarted on a new
        port)."""
        from mpo.parallel.ports import routable_address
        from mpo.rollout.client import EngineClient

        r = self.rollout
        if self.engines is not None:
            return self.engine_session()
        key = (*info["urls"], info["transport"])
        if self._sync is None or self._urls != key:
            self.close()
            # rank 0's key: engines the run started have one made there (EngineSet.api_key), not in this config
            clients = [EngineClient(url, api_key=info["api_key"], timeout_s=r.request_timeout_s)
                       for url in info["urls"]]
            host = urlsplit(info["urls"][0]).hostname or "127.0.0.1"
            self._sync = WeightSync(clients, engine=info["engine"], transport=info["transport"],
                                    bucket_bytes=self.sync.bucket_bytes, tp_sizes=info["tp_sizes"],
                                    master_address=routable_address(host),
                                    per_node=per_node_sync(info["transport"], info["engine"]))
            self._urls = key
        return self._sync

    def _stream(self, version: int) -> dict[str, float]:
        """Collective: every rank streams its shards; each stage's sender pushes HF buckets to every engine inside
        one weight-update session opened and closed by rank 0; mpo engines are then verified by checksum from
        per-tensor digests."""
        started = time.perf_counter()
        engines, streamer = self.engines, self.streamer
        r, m = self.rollout, self.model_section
        info: list[Any] = [None]
        if engines is not None:
            own = self.engine_session()  # first: making rank 0's WeightSync resolves "auto"
            info = [{"urls": [c.url for c in engines.clients], "engine": r.engine, "transport": own.transport,
                     "tp_sizes": list(own.tp_sizes), "api_key": engines.api_key}]
        if not one_rank():
            dist.broadcast_object_list(info, src=0)
        info = info[0]
        if info is None:  # no engines: nothing to push
            return {}
        routes = self._routes(info)
        rank = dist.get_rank() if not one_rank() else 0
        leader = routes is not None and rank in routes.node_of_engine
        sync = self._sender_sync(info) if streamer.is_sender or leader else None
        if sync is not None and routes is not None:  # this node's engines only (the other nodes' leaders push theirs)
            sync.push_to = {info["urls"][i] for i in self._claims[rank]}
        fp8 = r.engine_weights == "fp8_block"
        convert = _EngineFormat(r.engine_weights, keep=r.engine == "mpo")
        via = transport_class(info["transport"])
        at_once = via.stages_at_once(len(streamer.senders), len(info["urls"]))  # the same on every rank
        if sync is not None:
            sync.via.prepare(at_once)
        if r.engine == "mpo":
            engine_dtype = torch.bfloat16 if self.engine_dtype == "bf16" else torch.float32
            fp32_names = {"lm_head.weight"} if m.fp32_lm_head else set()

            def digest(name: str, tensor: torch.Tensor) -> str:
                if fp8:  # what the engine stores: the FP8 weight dequantized (convert saw this bucket first)
                    tensor = convert.engine_value(name, tensor)
                return tensor_digest(tensor if name in fp32_names else tensor.to(engine_dtype))
        else:
            digest = None
        if engines is not None:
            # A synchronous schedule syncs between rollouts: nothing is generating, no pause (or continue) is needed
            sync.begin_session(pause=self.pause)
        try:
            if not one_rank():
                dist.barrier()
            push = (lambda named: sync.push_bucket(convert(named), version, wait=False)) if sync is not None else None
            relay = None
            if routes is not None and routes.relayed:  # colocated on several nodes: each node's leader pushes there
                relay = self._relay(routes, rank, sync, version, info)
                push = (lambda named: relay.push(convert(named))) if streamer.is_sender else None
            # in place (shm): the engines read strided views of the slots, no conversion copies (block FP8 makes new
            # tensors anyway, from HF-shaped ones: views keep q/k/v's head-group axis)
            result = streamer.stream(push, sequential=not at_once, digest=digest, hf_views=via.in_place and not fp8)
            if relay is not None:
                relay.finish(RELAY_TIMEOUT_S)
                self.relayed = relay.relayed
            if not one_rank():
                dist.barrier()
        finally:
            if engines is not None:
                sync.end_session()
        # block FP8: the bytes pushed are the converted tensors' (fp8 + scales), not the trainer's
        pushed = float(convert.bytes) if fp8 else float(result.bytes)
        totals = torch.tensor([pushed, float(result.buckets), *convert.squares, float(self.relayed)],
                              dtype=torch.float64)
        self.relayed = 0
        all_reduce_(totals)  # a host tensor: NCCL needs it on the GPU, all_reduce_ moves it there and back
        digests: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        if digest is not None and one_rank():
            digests = [result.digests]
        elif digest is not None:
            dist.gather_object(result.digests, digests, dst=0)
        if engines is not None:
            engines.stale.difference_update(c.url for c in sync.live)  # they hold the current weights now
            if digest is not None:
                verify_checksum(sync.live, combine_digests(digests))
        seconds = time.perf_counter() - started
        metrics = {"sync_time_s": seconds, "sync_bytes": totals[0].item(), "sync_buckets": totals[1].item(),
                   "sync_bytes_per_s": totals[0].item() / max(seconds, 1e-9),
                   "sync_senders": float(len(streamer.senders))}
        if routes is not None and routes.relayed:  # buckets the nodes' leaders pushed for other nodes' senders
            metrics["sync_relayed_buckets"] = totals[4].item()
            metrics["sync_engine_nodes"] = float(len(set(routes.node_of_engine)))
            if engines is not None:  # each engine's own word that it runs this version (one GET per engine)
                metrics["sync_engines_at_version"] = float(sum(
                    str(c.call("/get_model_info", method="GET").get("weight_version")) == str(version)
                    for c in sync.live))
        if fp8:  # the weight error FP8 adds (on log-probs: train_rollout_logprob_absdiff, rollout_mismatch_*)
            metrics["sync_fp8_weight_rel_rmse"] = (totals[2].item() / max(totals[3].item(), 1e-300)) ** 0.5
        return metrics

    def verify_by_probe(self) -> dict[str, float]:
        """Collective, after the push: rank 0 extends the probe until the first engine's routed experts cover every
        expert (verify.covering_probe_runs); every rank scores the probe replaying that engine's routes (so the
        comparison sees weights, not routing flips); rank 0 compares every engine's log-probs with the trainer's
        (verify.check_probe: a wrong tensor fails, drift warns) and returns what it measured."""
        from mpo.rollout.protocol import route_dtype

        cfg, m = self.model_cfg, self.model_section
        box: list = [None]
        uncovered = 0
        if self.engines is not None:
            coverage = ProbeCoverage(num_experts=cfg.num_experts, num_layers=cfg.num_layers, topk=cfg.router_topk,
                                     vocab_size=cfg.vocab_size, moe_layers=cfg.moe_layers, seed=self.seed,
                                     max_sequences=self.sync.probe_max_sequences, strict=False)
            first = [[1 + (7 * i) % (cfg.vocab_size - 1) for i in range(PROBE_TOKENS)]]
            self.probes, runs, uncovered = covering_probe_runs(self.engines.clients[0], self.probes or first, coverage)
            box = [(self.probes, [run.routes.astype(route_dtype(cfg.num_experts, signed=True)) for run in runs])]
        dist.broadcast_object_list(box, src=0, group=self.object_group)
        probes, routes = box[0]
        reference, replayed = self._score_replaying(probes, routes)
        if self.engines is None:
            return {}
        metrics = check_probe(self.engines.clients, probes, reference, probe_bounds(self.engine_dtype, m.dtype),
                              num_layers=cfg.num_layers, topk=cfg.router_topk, num_experts=cfg.num_experts)
        return {**metrics, "sync_probe_tokens": float(sum(map(len, probes))),
                "sync_probe_uncovered_experts": float(uncovered), "sync_probe_replayed": float(replayed)}

    def _score_replaying(self, probes: list[list[int]], routes: list) -> tuple[list[list[float]], bool]:
        """Collective: score_probes with this stage's routers forced to the engine's `routes` (routing replay, one
        record per micro-batch the scorer runs: probes grouped by length in order of first appearance, as
        mpo.trainer.probes.trainer_probe_logprobs does); natural routing where this rank has no routing hooks."""
        from mpo.models.context_parallel import padded_width
        from mpo.routing.capture import CaptureConfig, _tap_for
        from mpo.routing.records import MicroBatchRouting, route_slots

        hooks = next((tap.hooks for module in self.model.modules() if (tap := _tap_for(module)) is not None), None)
        if hooks is None or not routes:
            return self.score_probes(probes), False
        cfg = self.model_cfg
        slots = route_slots(routes[0].shape[1], hooks.layers, num_layers=cfg.num_layers,
                            first_k_dense=cfg.first_k_dense)
        by_length: dict[int, list[int]] = {}
        for j, probe in enumerate(probes):
            by_length.setdefault(len(probe), []).append(j)
        records = []
        for length, rows in by_length.items():
            # as wide as the scorer's padded batch (context parallelism); the padding routes naturally (-1)
            indices = torch.full((len(rows), padded_width(length), len(slots), cfg.router_topk), -1, dtype=torch.int32)
            for b, j in enumerate(rows):  # the engine's routes of input positions 0..n-2; the last routes naturally
                indices[b, :length - 1] = torch.from_numpy(routes[j][:, slots].astype("int32"))
            records.append(MicroBatchRouting(tuple(hooks.layers), indices))
        with hooks.session(replay=records, config=CaptureConfig(record=False)):
            return self.score_probes(probes), True

    def close(self) -> None:
        """End this rank's weight-update session (distributed: its groups on the engines and here; shm: the spill
        buffer). Before the engines stop (mpo.trainer.loop.run); a failure is logged, not raised: the engines may
        already be gone, and stopping them must go on."""
        sync, self._sync = self._sync, None
        if sync is not None:
            try:
                sync.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("closing the weight-update session failed: %s", exc)


class _EngineFormat:
    """One sync's conversion of a sender's HF buckets into the engines' parameter format (rollout.engine_weights,
    mpo.weight_sync.fp8.to_engine_format), measuring what it pushed: the bytes of the converted tensors and, for
    block FP8, the relative RMSE the quantization adds (squared error of the dequantized weights against the
    trainer's, over the squared weights; summed on the tensors' device, read once per sync). `keep`: hold each
    bucket's dequantized weights until engine_value takes them (the mpo engine's checksum)."""

    def __init__(self, fmt: str, *, keep: bool) -> None:
        self.fmt, self.keep = fmt, keep
        self.bytes = 0
        self._sums: torch.Tensor | None = None  # [squared error, squared weights], float64
        self._dequantized: dict[str, torch.Tensor] = {}  # the current bucket's, until digested

    def __call__(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if self.fmt == "bf16":
            return named
        self._dequantized = {}
        out = list(to_engine_format(named, self.fmt))
        converted = dict(out)
        for name, tensor in named:
            if converted[name] is tensor:  # left as it is (kept unquantized in FP8 checkpoints)
                continue
            value = dequantize_block(converted[name], converted[scale_name(name)])
            reference = tensor.detach().float()
            sums = torch.stack([(value - reference).square().sum(dtype=torch.float64),
                                reference.square().sum(dtype=torch.float64)])
            self._sums = sums if self._sums is None else self._sums + sums
            if self.keep:
                self._dequantized[name] = value
        self.bytes += sum(t.numel() * t.element_size() for _, t in out)
        # grouped by dtype (stable): SGLang's flattened buckets hold one dtype each, and alternating fp8 weights and
        # fp32 scales would make a payload per tensor; engines pair weight and scale within the session, in any order
        out.sort(key=lambda item: str(item[1].dtype))
        return out

    @property
    def squares(self) -> tuple[float, float]:
        """(squared error, squared weights) of the weights this sender quantized so far."""
        return (0.0, 0.0) if self._sums is None else tuple(self._sums.tolist())

    def engine_value(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What an engine loading this sync holds for `name` before rounding to its dtype: the FP8 weight
        dequantized, or `tensor` itself where block FP8 leaves it unquantized."""
        if name in self._dequantized:
            return self._dequantized.pop(name)
        if self.fmt == "fp8_block" and is_quantized(name, tensor.shape):  # not converted here (a push without engines)
            return dequantize_block(*quantize_block(tensor))
        return tensor
