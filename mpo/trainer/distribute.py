"""A step's samples from rank 0 to the ranks that train on them (issue #31): each data-parallel rank receives only its
own share, each pipeline stage only its own MoE layers' routes.

At Qwen3-30B-A3B a step is ~55M tokens; broadcasting every sample (with every layer's routes) to every rank made each
rank receive and unpickle the whole batch. Here rank 0 sends each rank one pickle holding
* full samples for the ones its data-parallel rank trains on, with routes cut to its stage's layers, per-token fields
  as compact numpy arrays (ids int32, log-probs, advantages and loss mask float32: what the rows become anyway);
* for every other sample only what the split needs: its length (ids = :class:`Elsewhere`), prompt length, group and
  reward, so every rank still computes the same uniform row length, micro-batch counts and packing plans.

Which data-parallel rank trains on a sample is :func:`dp_owners`: the split Trainer.pass_microbatches makes
(mini-batch u = samples[u::updates]; round-robin within it for padded rows, mpo.trainer.rows; Karmarkar-Karp over
lengths with schedule.max_tokens_per_microbatch, mpo.trainer.packing). A rank that ever reads another rank's sample
fails loudly (Elsewhere raises), so the two cannot drift apart silently.

Rank 0 may first ask every rank to publish the weights again (Distributor.republish; mpo.weight_sync tells when).

Transport: point-to-point sends on the gloo object group, the same on GPU and CPU. Ranks with the same data-parallel
rank and stage (tensor / context parallel peers) get the same pickle, made once.

Waiting for a rollout of any length (issue #45): every other rank waits while rank 0 generates, and a 32k-token step
takes 35-50 minutes, longer than parallel.distributed_timeout_s (1800 s), the bound of any one gloo receive. So no
rank waits in a receive: rank 0 announces each message on the job's store (the rendezvous TCPStore) before it sends
it, and beats a counter there every timeout/6 s from a thread while the Distributor lives. A waiting rank polls the
store and posts its receive only once the message is announced; it waits as long as the beats go on, and fails in one
line once they stop for distributed_timeout_s (rank 0 hangs without its threads) or the store is gone (rank 0 died:
it hosts the store). What a rank waits for is bounded by rank 0's own limits on the rollout (request timeouts).
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from mpo.routing.records import route_slots
from mpo.trainer.rows import Elsewhere, Sample

log = logging.getLogger(__name__)
_instances = itertools.count()  # Distributors made so far: the same on every rank (each one is a collective)


def dp_owners(lengths: list[int], *, updates: int, dp_size: int, packed: bool) -> list[int]:
    """The data-parallel rank that trains on each sample (see the module docstring)."""
    from mpo.trainer.packing import karmarkar_karp

    owners = [0] * len(lengths)
    for u in range(updates):
        members = list(range(u, len(lengths), updates))
        if packed:
            for d, share in enumerate(karmarkar_karp([lengths[i] for i in members], dp_size)):
                for j in share:
                    owners[members[j]] = d
        else:
            for j, i in enumerate(members):
                owners[i] = j % dp_size
    return owners


def _array(values, dtype) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=dtype)


def share_for(samples: list[Sample], owners: list[int], dp_rank: int, layers: tuple[int, ...], *, num_layers: int,
              first_k_dense: int = 0) -> list[Sample]:
    """What data-parallel rank `dp_rank` with stage layers `layers` receives: its own samples whole (routes cut to
    `layers`), the others as lengths."""
    out = []
    for s, owner in zip(samples, owners):
        if owner != dp_rank:
            out.append(Sample(ids=Elsewhere(len(s.ids)), prompt_len=s.prompt_len, group=s.group, reward=s.reward))
            continue
        routes = None
        if s.routes is not None:
            slots = route_slots(s.routes.shape[1], layers, num_layers=num_layers, first_k_dense=first_k_dense)
            routes = np.ascontiguousarray(s.routes[:, slots])
        advantage = s.advantage if isinstance(s.advantage, (int, float)) else _array(s.advantage, np.float32)
        out.append(replace(s, ids=np.asarray(s.ids, dtype=np.int32), advantage=advantage, routes=routes,
                           route_layers=tuple(layers) if routes is not None else None,
                           rollout_logprobs=_array(s.rollout_logprobs, np.float32),
                           loss_mask=_array(s.loss_mask, np.float32),
                           versions=None))  # rank 0 keeps them (staleness, versions.jsonl); no one else reads them
    return out


class Distributor:
    """Rank 0's samples -> every rank's view (call on every rank; a collective on the object group).

    Args:
        group: the gloo group of every rank (ParallelContext.object_group).
        layers: the MoE layer numbers of this rank's pipeline stage (its routing hooks' layers).
        num_layers, first_k_dense: the model's layer count and dense first layers (to index the engine's routes).
    """

    def __init__(self, group, *, dp_rank: int, layers: tuple[int, ...], num_layers: int, first_k_dense: int = 0):
        self.group = group
        self.rank = dist.get_rank()
        self.me = (dp_rank, tuple(layers))
        self.num_layers, self.first_k_dense = num_layers, first_k_dense
        self.on_republish: Callable[[], None] | None = None  # this rank's side of a weight publish (republish())
        self.ranks: list = [None] * dist.get_world_size()  # every rank's (dp_rank, layers)
        dist.all_gather_object(self.ranks, self.me, group=self.group)
        self.timeout_s = group_timeout_s(group)
        self.waiter = RolloutWait(f"mpo/distribute/{next(_instances)}/", self.timeout_s) \
            if dist.get_world_size() > 1 else None
        if self.waiter is not None and self.rank == 0:
            self.waiter.start_heartbeat()

    def close(self) -> None:
        """Stop rank 0's heartbeat (the waiting ranks then fail after the timeout if they still wait)."""
        if self.waiter is not None:
            self.waiter.stop_heartbeat()

    def republish(self) -> None:
        """Rank 0, before it sends a step's samples: every rank (the others wait in _receive) publishes again."""
        if self.waiter is not None:
            self.waiter.announce()
        for dst in range(1, dist.get_world_size()):
            dist.send(torch.tensor([-1], dtype=torch.int64), dst=dst, group=self.group)
        self.on_republish()

    def __call__(self, samples: list[Sample] | None, *, updates: int, dp_size: int, packed: bool) -> list[Sample]:
        if self.rank != 0:
            return self._receive()
        owners = dp_owners([len(s.ids) for s in samples], updates=min(updates, len(samples)) or 1, dp_size=dp_size,
                           packed=packed)
        made: dict[tuple, bytes] = {}
        pending = []
        for dst, key in enumerate(self.ranks):
            if dst == 0:
                continue
            if key not in made:
                made[key] = pickle.dumps(share_for(samples, owners, key[0], key[1], num_layers=self.num_layers,
                                                   first_k_dense=self.first_k_dense),
                                         protocol=pickle.HIGHEST_PROTOCOL)
            payload = torch.frombuffer(bytearray(made[key]), dtype=torch.uint8)  # a pickle is never empty
            size = torch.tensor([payload.numel()], dtype=torch.int64)
            pending += [(dist.isend(size, dst=dst, group=self.group), size),
                        (dist.isend(payload, dst=dst, group=self.group), payload)]  # tensors live until sent
        mine = share_for(samples, owners, *self.me, num_layers=self.num_layers, first_k_dense=self.first_k_dense)
        if pending:
            self.waiter.announce()  # the receivers post their receives now (the sends above wait for them)
        for work, _ in pending:
            work.wait()
        return mine

    def _receive(self) -> list[Sample]:
        size = torch.zeros(1, dtype=torch.int64)
        self.waiter.wait()
        dist.recv(size, src=0, group=self.group)
        while int(size) < 0:  # rank 0 asks for a re-publish first (republish)
            self.on_republish()
            self.waiter.wait()
            dist.recv(size, src=0, group=self.group)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(payload, src=0, group=self.group)
        return pickle.loads(memoryview(payload.numpy()))


def group_timeout_s(group) -> float:
    """The timeout of `group`'s gloo backend (None: the default group), 1800 s where torch does not say."""
    group = group or dist.group.WORLD
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return 1800.0
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class RolloutWait:
    """Rank 0's announcements and heartbeat on the job's store, and the other ranks' wait for them (see the module
    docstring). Keys live under `prefix`; `timeout_s` is how long the beats may stop before a waiting rank gives up.
    Every rank makes one (in the same order: the prefix names it)."""

    def __init__(self, prefix: str, timeout_s: float) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.sent_key, self.beat_key = prefix + "sent", prefix + "beat"
        self.timeout_s = timeout_s
        self.beat_every_s = max(timeout_s / 6, 0.05)
        self.poll_s = min(1.0, max(timeout_s / 20, 0.05))  # a step's messages start at most this late
        self.seen = 0  # messages announced that this rank has taken
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- rank 0 --------------------------------------------------------------------------------------------------
    def announce(self) -> None:
        self.store.add(self.sent_key, 1)

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="mpo-rollout-heartbeat", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(self.beat_key, 1)
            except Exception:  # the store is gone: the job is ending (its teardown says why)
                return
            self._stop.wait(self.beat_every_s)

    # -- the other ranks -----------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Until rank 0 announces the next message: as long as its heartbeat goes on; one line when it stops."""
        started = last_change = time.monotonic()
        beats, logged = None, started
        while True:
            try:
                sent = self.store.add(self.sent_key, 0)
                now_beats = self.store.add(self.beat_key, 0)
            except Exception as exc:
                raise RuntimeError(f"rank {dist.get_rank()} lost rank 0's store after waiting "
                                   f"{time.monotonic() - started:.0f} s for a step's samples: rank 0 died (its log "
                                   f"says why) ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                                   ) from None
            if sent > self.seen:
                self.seen += 1
                return
            now = time.monotonic()
            if now_beats != beats:
                beats, last_change = now_beats, now
            elif now - last_change > self.timeout_s:
                raise RuntimeError(f"rank {dist.get_rank()}: rank 0 sent no heartbeat for {now - last_change:.0f} s "
                                   f"(parallel.distributed_timeout_s={self.timeout_s:g}) while this rank waited "
                                   f"{now - started:.0f} s for a step's samples: rank 0 hangs or died; see its log")
            if now - logged > 600:  # a long rollout is normal; say so now and then
                log.info("waiting %.0f s for rank 0's rollout (its heartbeat goes on)", now - started)
                logged = now
            time.sleep(self.poll_s)
