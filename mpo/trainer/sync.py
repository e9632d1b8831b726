"""The trainer's weight sync after each step: mpo.rollout.streaming on every rank, engines driven by the senders.

Rank 0 owns the engines (mpo.trainer.loop.EngineSet) and the weight-update session; the sender of every other
pipeline stage gets the engine URLs from rank 0 (one small broadcast per sync) and pushes its own buckets with its
own WeightSync (its own weight-update group for the distributed transport, rendezvous at this host's address on the
route to the engines). No rank gathers the full model (mpo.models.full_state.gather_full_state stays for checks).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class _RankState:
    streamer: Any  # WeightStreamer
    sync: Any = None  # this sender's WeightSync (rank 0: the EngineSet's)
    urls: tuple = ()


_STATE: "weakref.WeakKeyDictionary[Any, _RankState]" = weakref.WeakKeyDictionary()


def _state(trainer) -> _RankState:
    from checkpoints_tools.mapping import mapping_for
    from mpo.rollout.streaming import WeightStreamer

    state = _STATE.get(trainer)
    r = trainer.config.rollout
    shared = r.host_shared_memory
    if state is None or (shared is not None and state.streamer.shared != shared):  # made once (collective)
        streamer = WeightStreamer(trainer.gpt, mapping_for(trainer.model_cfg, spec="local"),
                                  stage=trainer.ps.get_pipeline_model_parallel_rank(),
                                  bucket_bytes=r.bucket_mb << 20, device=trainer.ctx.device.device,
                                  host_shared_memory=shared)
        state = _STATE[trainer] = _RankState(streamer)
    return state


def _sender_sync(trainer, state: _RankState, engines, info: dict):
    """This sender's WeightSync: rank 0 uses the EngineSet's; other senders make theirs for the engines rank 0 named
    (remade when the URLs change, e.g. after a local engine restarted on a new port)."""
    from mpo.rollout.client import EngineClient
    from mpo.rollout.streaming import routable_address
    from mpo.rollout.weight_sync import WeightSync

    if engines is not None:
        return engines.weight_sync(bucket_bytes=trainer.config.rollout.bucket_mb << 20)
    key = (*info["urls"], info["transport"])
    if state.sync is None or state.urls != key:
        if state.sync is not None:
            state.sync.close()
        r = trainer.config.rollout
        clients = [EngineClient(url, api_key=r.api_key, timeout_s=r.request_timeout_s) for url in info["urls"]]
        host = urlsplit(info["urls"][0]).hostname or "127.0.0.1"
        state.sync = WeightSync(clients, engine=info["engine"], transport=info["transport"],
                                bucket_bytes=r.bucket_mb << 20, tp_sizes=info["tp_sizes"],
                                master_address=routable_address(host))
        state.urls = key
    return state.sync


def _copy_as(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A copy of a bucket tensor in its HF shape (one copy, whatever the view's layout)."""
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    out.view(tensor.shape).copy_(tensor)
    return out


def stream_sync(trainer, engines, version: str) -> dict[str, float]:
    """Collective over the trainer world: every rank streams its shards; each stage's sender pushes HF buckets to
    every engine inside one weight-update session opened and closed by rank 0; mpo engines are then verified by
    checksum from per-tensor digests. Returns the sync metrics (on every rank)."""
    import time

    from mpo.parallel.collectives import all_reduce_
    from mpo.rollout.weight_sync import combine_digests, tensor_digest

    started = time.perf_counter()
    state = _state(trainer)
    r, m = trainer.config.rollout, trainer.config.model
    info = [None]
    if engines is not None:
        sync0 = engines.weight_sync(bucket_bytes=r.bucket_mb << 20)
        info = [{"urls": [c.url for c in engines.clients], "engine": r.engine, "transport": engines.transport,
                 "tp_sizes": list(sync0.tp_sizes)}]
    dist.broadcast_object_list(info, src=0)
    info = info[0]
    if info is None:  # no engines: nothing to push
        return {}
    streamer = state.streamer
    sync = _sender_sync(trainer, state, engines, info) if streamer.is_sender else None
    digest = None
    if r.engine == "mpo":
        engine_dtype = torch.bfloat16 if (r.engine_dtype or m.dtype) == "bf16" else torch.float32
        fp32_names = {"lm_head.weight"} if m.fp32_lm_head else set()

        def digest(name: str, tensor: torch.Tensor) -> str:
            return tensor_digest(tensor if name in fp32_names else tensor.to(engine_dtype))

    remembered: list = []
    keep = engines is not None and bool(engines.processes)  # a restarted local engine gets them (CPU demo sizes)
    shm = info["transport"] == "shm"  # the engines read strided views of the slots: no conversion copies

    def push(named):
        pending = sync.push_bucket(named, version, wait=False)
        if keep:  # the bucket's tensors are views of a slot the next buckets reuse (q/k/v: of another shape)
            remembered.extend((name, _copy_as(tensor, streamer.hf_shapes[name])) for name, tensor in named)
        return pending

    if engines is not None:
        sync.begin_session()
    try:
        dist.barrier()
        result = streamer.stream(push if sync is not None else None,
                                 sequential=info["transport"] == "distributed", digest=digest, hf_views=shm)
        dist.barrier()
    finally:
        if engines is not None:
            sync.end_session()
    totals = torch.tensor([float(result.bytes), float(result.buckets)], dtype=torch.float64)
    all_reduce_(totals)  # a host tensor: NCCL needs it on the GPU, all_reduce_ moves it there and back
    digests: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    if digest is not None:
        dist.gather_object(result.digests, digests, dst=0)
    if engines is not None:
        if keep:
            if len(streamer.senders) > 1:
                log.warning("local engines with %d pipeline stages: a restarted engine gets only stage 0's weights "
                            "until the next sync", len(streamer.senders))
            engines.remember(remembered, version)
        if digest is not None:
            merged: dict[str, str] = {}
            for part in digests:
                merged.update(part or {})
            sync.verify_checksum(combine_digests(merged))
    seconds = time.perf_counter() - started
    return {"sync_time_s": seconds, "sync_bytes": totals[0].item(), "sync_buckets": totals[1].item(),
            "sync_bytes_per_s": totals[0].item() / max(seconds, 1e-9), "sync_senders": float(len(streamer.senders))}
