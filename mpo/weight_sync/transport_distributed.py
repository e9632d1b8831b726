"""The "distributed" transport (see mpo.weight_sync). NCCL on GPU, gloo on CPU; engines on any node."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Sequence

import torch

from mpo.rollout.client import EngineClient, EngineError
from mpo.weight_sync.transports import TRANSPORTS, NamedTensors, PendingPush, Transport, _Calls
from mpo.weight_sync.wire import (SGLANG_FORMAT, dtype_name, group_layout, host_weight_update_store,
                                  join_weight_update_group, pack_bucket)

log = logging.getLogger(__name__)


@TRANSPORTS.register("distributed")
class DistributedTransport(Transport):
    what = "the process-group path"
    engines = ("mpo", "sglang")
    drops_dead_engines = False  # a dead member would leave the group's collectives hanging
    call_unit = "collectives"

    def __init__(self, session) -> None:
        super().__init__(session)
        # The groups, each (its engines, the group, its name), this sender rank 0 in each.
        # group_per_engine=False (the default): ONE group with every engine's ranks, so a bucket is one broadcast
        # for all engines (NCCL's tree/ring: the sender's link carries it about once); right for a single sender,
        # or senders taking turns. An engine serves one collective at a time, so two senders pushing at once over
        # such groups could each hold an engine the other's broadcast needs (deadlock).
        # group_per_engine=True: a group per engine; each collective then needs one engine only, and every sender
        # pushes a bucket to the engines in the same order, so the lowest engine with work always progresses:
        # senders (pipeline stages) push at once. The cost: the sender's link carries each bucket once per engine.
        # Either way an engine GPU is in one group per sender (mpo.memory_plan.sync_shape states which is cheaper;
        # mpo.weight_sync.publisher picks the same).
        self.group_per_engine = False
        self.groups: list[tuple[list[EngineClient], torch.distributed.ProcessGroup, str]] = []
        self.group_name = f"mpo_weight_sync_{uuid.uuid4().hex[:8]}"

    # -- what it can reach ---------------------------------------------------------------------------------------
    @classmethod
    def check_colocated(cls, engine: str) -> None:
        """Colocated SGLang engines: a trainer GPU and an engine GPU that are the same device would be in one NCCL
        group (NCCL refuses a device twice in a communicator); mpo's engines (CPU, gloo) have no such limit."""
        if engine == "sglang":
            raise ValueError("sync.transport='distributed' with rollout.colocate=true: the engines' GPUs are "
                             "trainer GPUs and NCCL cannot hold one device twice in the weight-update group; use "
                             "sync.transport='cuda_ipc' or 'tensor' (each node's engines are pushed to from that node) "
                             "or give the engines nodes of their own (rollout.colocate=false)")

    @classmethod
    def stages_at_once(cls, senders: int, engines: int) -> bool:
        """At once with a group per engine, each sender's link then carrying every bucket once per engine: at once
        costs stage bytes x engines per link, in turns the model's bytes once (one broadcast tree per bucket), so at
        once wins while engines <= senders (PP16 into 2 engines: 8x less)."""
        return engines <= senders

    @classmethod
    def link_copies(cls, engines: int, tp: int, at_once: bool) -> float:
        return engines if at_once else 1

    @classmethod
    def calls_per_bucket(cls, engines: int, at_once: bool) -> int:
        return engines if at_once else 1  # in turns one broadcast reaches every engine

    @classmethod
    def groups_per_engine_gpu(cls, senders: int) -> int:
        return senders  # one group per sender (with every engine, or with this engine alone when at once)

    # -- one session ---------------------------------------------------------------------------------------------
    def check_session(self) -> None:
        from urllib.parse import urlsplit

        from mpo.parallel.ports import is_loopback

        s = self.session
        far = next((c.url for c in s.clients if not is_loopback(urlsplit(c.url).hostname or "")), None)
        if far is not None and is_loopback(s.master_address):
            raise ValueError(f"sync.transport='distributed': engine {far} cannot reach trainer rank 0 at "
                             f"{s.master_address}; set sync.master_address to an address of this host that "
                             f"the engines can route to (the launcher sets it)")

    def prepare(self, at_once: bool) -> None:
        if not self.groups:  # decided before the groups exist (stages_at_once)
            self.group_per_engine = at_once

    def push(self, bucket: NamedTensors, version: str, *, wait: bool) -> PendingPush | None:
        """The bucket broadcast ONCE per engine group (see mpo.weight_sync; the wire: wire.pack_bucket)."""
        if not self.groups:
            self.connect()
        timeout_s = self.session.timeout_s
        nccl = self.session.backend == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        flat, manifest = pack_bucket(bucket, device=device)  # alive until every broadcast completed
        names = [m.name for m in manifest]
        dtypes = [dtype_name(m.dtype) for m in manifest]
        shapes = [list(m.shape) for m in manifest]
        name_of = {c.url: name for members, _, name in self.groups for c in members}
        calls = _Calls([c for members, _, _ in self.groups for c in members],
                       lambda c: c.update_weights_from_distributed(
                           names=names, dtypes=dtypes, shapes=shapes, group_name=name_of[c.url],
                           load_format=SGLANG_FORMAT, weight_version=version))
        # in engine order on every sender (see __init__)
        works = [torch.distributed.broadcast(flat, src=0, group=group, async_op=True) for _, group, _ in self.groups]
        self.collectives += len(works)
        # An engine answers only once it has received the bucket, so every call returning means every broadcast
        # reached its engine; an engine that refuses before receiving (e.g. an unknown group) would leave the
        # broadcasts waiting: the first refusal ends the wait, with the engine's own error.
        deadline = time.monotonic() + timeout_s
        if not calls.settled.wait(timeout_s):
            raise EngineError(self.session.clients[0].url, "/update_weights_from_distributed",
                              f"bucket of {len(names)} tensors not done after {timeout_s:.0f} s")
        if calls.errors and not all(w.is_completed() for w in works):
            self.groups = []  # the groups are out of step now; the next push makes new ones
            calls.raise_first()
        calls.join(max(0.0, deadline - time.monotonic()))  # raises the first error, if one came after the broadcasts
        for work in works:
            work.wait()
        return None

    def connect(self) -> None:
        """Create the weight-update group(s) (see __init__): this sender as rank 0 plus every engine's TP ranks
        (engine i from its rank offset), or one group per engine."""
        s = self.session
        if self.group_per_engine:
            self.groups = [([c], self._join([c], [tp], f"{self.group_name}_e{i}"), f"{self.group_name}_e{i}")
                           for i, (c, tp) in enumerate(zip(s.clients, s.tp_sizes))]
        else:
            self.groups = [(list(s.clients), self._join(s.clients, s.tp_sizes, self.group_name), self.group_name)]

    def _join(self, clients: Sequence[EngineClient], tp_sizes: Sequence[int], name: str
              ) -> torch.distributed.ProcessGroup:
        s = self.session
        world_size, offsets = group_layout(tp_sizes)
        timeout = timedelta(seconds=s.timeout_s)
        store = host_weight_update_store(s.master_address, world_size, timeout)  # listening before engines hear of it
        by_url = dict(zip((c.url for c in clients), offsets))
        calls = _Calls(clients, lambda c: c.init_weights_update_group(
            master_address=s.master_address, master_port=store.port, rank_offset=by_url[c.url],
            world_size=world_size, group_name=name, backend=s.backend))
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = join_weight_update_group(s.master_address, store.port, world_size, name,
                                                           backend=s.backend, rank=0, timeout=timeout, store=store)
            except BaseException as exc:  # noqa: BLE001
                joined["error"] = exc

        trainer = threading.Thread(target=join, daemon=True)
        trainer.start()
        deadline = time.monotonic() + s.timeout_s
        while trainer.is_alive() or not calls.done():
            if calls.errors:
                calls.raise_first()
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight-update group {name}: not all of {world_size} ranks joined "
                                   f"within {s.timeout_s:.0f} s")
            time.sleep(0.01)
        calls.raise_first()
        if "error" in joined:
            raise joined["error"]
        return joined["group"]

    def close(self) -> None:
        groups, self.groups = self.groups, []
        try:
            for members, _, name in groups:
                for client in members:
                    try:
                        client.call("/destroy_weights_update_group", {"group_name": name})
                    except EngineError as exc:  # a member that is gone (dropped: EngineSet) took its group
                        # with it and must not keep the others' alive; one that answered with an error is worth a line
                        (log.debug if exc.status is None else log.warning)("weight-update group %s: %s", name, exc)
        finally:
            for _, group, _ in groups:
                torch.distributed.destroy_process_group(group)
