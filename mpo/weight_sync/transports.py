"""The transports (see mpo.weight_sync): how a bucket reaches the engines, and which engines each one can reach.

TRANSPORTS is the registry: every transport declares the engine kinds it serves and those that must run on the
trainer's host for it. `check_transport` is the one compatibility check; config validation (engine kinds), the
launcher (engine placement) and WeightSync (engine URLs, on every sender) all ask it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal, Sequence

import torch

from mpo.parallel.ports import free_port
from mpo.rollout.client import EngineClient, EngineError
from mpo.weight_sync.wire import (MPO_FORMAT, SGLANG_FORMAT, SHM_FORMAT, cuda_ipc_payload, dtype_name,
                                  encode_mpo_bucket, flattened_bucket_payload, group_layout, join_weight_update_group,
                                  pack_bucket)

NamedTensors = list[tuple[str, torch.Tensor]]
EngineKind = Literal["mpo", "sglang"]


@dataclass(frozen=True)
class Transport:
    """One way weights reach engines: `what` it is (for messages), the `engines` kinds it serves, and those of them
    that must run on the trainer's host (node) to be reached this way (`same_host`)."""

    what: str
    engines: tuple[str, ...]
    same_host: tuple[str, ...] = ()


TRANSPORTS: dict[str, Transport] = {
    # each bucket in the HTTP body of /update_weights_from_tensor (mpo: safetensors; SGLang: a flattened bucket)
    "tensor": Transport("the HTTP-body path", ("mpo", "sglang"), same_host=("sglang",)),
    # a process group per sender with every engine rank (or per sender and engine: stages at once); each bucket ONE
    # broadcast of its flattened buffer (NCCL / gloo)
    "distributed": Transport("the process-group path", ("mpo", "sglang")),
    # SGLang engines on the trainer's own GPUs map each bucket through a CUDA IPC handle (GPU only)
    "cuda_ipc": Transport("SGLang's colocated GPU path", ("sglang",), same_host=("sglang",)),
    # mpo engines on the trainer's host read each bucket in place from shared memory (CPU)
    "shm": Transport("mpo's engine's same-host path", ("mpo",), same_host=("mpo",)),
}


def resolve_transport(transport: str, engine: str, *, started_here: bool, is_gpu: bool,
                      shared_memory: bool | None = None) -> str:
    """The transport `sync.transport` names; "auto" (the default) is "shm" for mpo engines this run starts on a CPU
    host (buckets read in place: the demo's sync 3.7 -> 2.6 s per 100 steps, the same learning) unless
    `sync.host_shared_memory` is false (`shared_memory`: a container with a tiny /dev/shm), and "tensor" for every
    other engine (engines on other nodes that "tensor" cannot reach need "distributed", which the recipes and the
    launcher's placement checks name)."""
    if transport != "auto":
        return transport
    return "shm" if engine == "mpo" and started_here and not is_gpu and shared_memory is not False else "tensor"


def check_transport(transport: str, engine: str, *, off_host: str | None = None) -> None:
    """Raise ValueError (one line, naming sync.transport) unless `transport` serves `engine` engines; `off_host`
    describes an engine that is not on the trainer's host (node), if there is one. "auto" is checked as what it is
    for engines a run does not start itself: "tensor"."""
    spec = TRANSPORTS.get("tensor" if transport == "auto" else transport)
    if spec is None:
        raise ValueError(f"sync.transport must be one of 'auto', {', '.join(map(repr, TRANSPORTS))}, "
                         f"got {transport!r}")
    if engine not in spec.engines:
        takes = [repr(name) for name, t in TRANSPORTS.items() if engine in t.engines]
        raise ValueError(f"sync.transport={transport!r} is {spec.what}; rollout.engine={engine!r} takes "
                         f"{', '.join(takes[:-1])} or {takes[-1]}")
    if off_host is not None and engine in spec.same_host:
        raise ValueError(f"sync.transport={transport!r} is for {engine} engines on the trainer's node; {off_host}: set "
                         f"sync.transport='distributed'")


def stages_at_once(transport: str, senders: int, engines: int) -> bool:
    """Whether the pipeline stages' senders push at once (else they take turns). Every transport but "distributed"
    always does. "distributed" does with a group per engine (WeightSync.group_per_engine), each sender's link then
    carrying every bucket once per engine: at once costs stage bytes x engines per link, in turns the model's bytes
    once (one broadcast tree per bucket), so at once wins while engines <= senders (PP16 into 2 engines: 8x less)."""
    return transport != "distributed" or engines <= senders


NODE_GPUS = 8  # GPUs of a node where no allocation is known (check-config, mpo plan): H100 / H200 nodes


def same_host(transport: str, engine: str) -> bool:
    """Whether `transport` reaches `engine` engines only from their own node ("auto" as check_transport reads it):
    such a sync is routed per node (mpo.weight_sync.relay)."""
    spec = TRANSPORTS.get("tensor" if transport == "auto" else transport)
    return spec is not None and engine in spec.same_host


def per_node_sync(transport: str, engine: str) -> bool:
    """Whether this rank's sync routes buckets per node (mpo.weight_sync.relay): a same-host transport in a run the
    launcher placed on several trainer nodes with engines on them (it sets MPO_NODE_HOST exactly then). Elsewhere an
    engine off this host is refused up front, as check_transport says."""
    import os

    from mpo.weight_sync.relay import NODE_HOST_ENV

    return same_host(transport, engine) and bool(os.environ.get(NODE_HOST_ENV))


def check_colocated(transport: str, engine: str, *, trainer_nodes: int) -> None:
    """Raise ValueError (one line) when engines colocated on the trainer's GPUs cannot be synced: "distributed"
    would put a trainer GPU and an engine GPU that are the same device into one NCCL group (NCCL refuses a device
    twice in a communicator). Over several trainer nodes (`trainer_nodes`) the same-host transports ("cuda_ipc",
    "tensor", "auto") reach each node's engines from that node's leader (mpo.weight_sync.relay); mpo's engines
    (CPU, gloo) have no limit beyond check_transport's."""
    if engine != "sglang":
        return
    if transport == "distributed":
        raise ValueError("sync.transport='distributed' with rollout.colocate=true: the engines' GPUs are trainer GPUs "
                         "and NCCL cannot hold one device twice in the weight-update group; use sync.transport="
                         "'cuda_ipc' or 'tensor' (each node's engines are pushed to from that node) or give the "
                         "engines nodes of their own (rollout.colocate=false)")


log = logging.getLogger(__name__)

# How a sync pauses engines with requests in flight (SGLang's pause_generation modes): "retract" sends them back to
# the queue, to be recomputed under the new weights (WeightSync.begin_session says why not "in_place" or "abort").
PAUSE_MODE = "retract"


class _Calls:
    """HTTP calls to several engines in threads, so the trainer can take part in a collective meanwhile."""

    def __init__(self, clients: Sequence[EngineClient], call: Callable[[EngineClient], Any]) -> None:
        self.errors: dict[str, BaseException] = {}
        self.threads = [threading.Thread(target=self._run, args=(client, call), daemon=True) for client in clients]
        for thread in self.threads:
            thread.start()

    def _run(self, client: EngineClient, call: Callable[[EngineClient], Any]) -> None:
        try:
            call(client)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.errors[client.url] = exc

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def raise_first(self, tolerate: Callable[[str, BaseException], bool] | None = None) -> None:
        """Raise the first error that `tolerate(url, error)` does not accept (all of them without it)."""
        for url, exc in self.errors.items():
            if tolerate is None or not tolerate(url, exc):
                raise exc

    def join(self, timeout_s: float, tolerate: Callable[[str, BaseException], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.raise_first(tolerate)
        if not self.done():
            raise TimeoutError(f"engine calls did not return within {timeout_s:.0f} s")


class PendingPush:
    """One bucket's engine calls, still running in threads (WeightSync.push_bucket(wait=False))."""

    def __init__(self, calls: _Calls, timeout_s: float,
                 tolerate: Callable[[str, BaseException], bool] | None = None) -> None:
        self.calls, self.timeout_s, self.tolerate = calls, timeout_s, tolerate

    def wait(self) -> None:
        """Return once every engine answered; raise the first engine's error (except one WeightSync dropped: an
        expendable engine that died), or TimeoutError after timeout_s."""
        self.calls.join(self.timeout_s, self.tolerate)


class WeightSync:
    """Pushes HF-named weights to every engine of one kind over one transport, inside SGLang's weight-update session.

    Args:
        clients: the engines (all of `engine` kind).
        engine: "mpo" or "sglang": picks the tensor-path payload and the verification.
        transport: a TRANSPORTS name.
        bucket_bytes: bucket size.
        tp_sizes: TP size of each engine (distributed ranks; tensor payloads are sent once per TP rank).
        backend: process-group backend for "distributed" (default: nccl when CUDA is available, else gloo).
        master_address: address the engines reach the trainer's rendezvous at.
        timeout_s: how long a collective step may take before the sync fails.
        per_node: a same-host transport whose buckets reach each node's engines from that node (mpo.weight_sync.
            relay): engines on other nodes are not refused here, and `push_to` (set by the publisher) limits the
            pushes to this node's; sessions still open and close on every engine.
    """

    def __init__(self, clients: Sequence[EngineClient], *, engine: EngineKind = "mpo", transport: str = "tensor",
                 bucket_bytes: int = 64 << 20, tp_sizes: Sequence[int] | None = None, backend: str | None = None,
                 master_address: str = "127.0.0.1", timeout_s: float = 120.0, per_node: bool = False) -> None:
        from urllib.parse import urlsplit

        from mpo.parallel.ports import is_local_host, is_loopback

        if engine not in ("mpo", "sglang"):
            raise ValueError(f"engine must be 'mpo' or 'sglang', got {engine!r}")
        hosts = {c.url: urlsplit(c.url).hostname or "" for c in clients}
        remote = next((url for url, host in hosts.items() if not is_local_host(host)), None)
        check_transport(transport, engine,
                        off_host=None if per_node else remote and f"engine {remote} is on another node")
        far = next((url for url, host in hosts.items() if not is_loopback(host)), None)
        if transport == "distributed" and far is not None and is_loopback(master_address):
            raise ValueError(f"sync.transport='distributed': engine {far} cannot reach trainer rank 0 at "
                             f"{master_address}; set sync.master_address to an address of this host that "
                             f"the engines can route to (the launcher sets it)")
        self.clients = list(clients)
        self.engine, self.transport, self.bucket_bytes = engine, transport, bucket_bytes
        self.tp_sizes = list(tp_sizes or [1] * len(self.clients))
        if len(self.tp_sizes) != len(self.clients):
            raise ValueError(f"{len(self.tp_sizes)} tp_sizes for {len(self.clients)} engines")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address, self.timeout_s = master_address, timeout_s
        # distributed: the groups, each (its engines, the group, its name), this sender rank 0 in each.
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
        self.collectives = 0  # collectives (broadcasts) this WeightSync issued: the sync's shape, for benches/tests
        self._spill = None  # shm transport: shared buffer for tensors that are not in a shared slot already
        # expendable(client): whether that engine, having failed a call, may be left out of the rest of the session
        # (EngineSet: a local engine whose process died; it is restarted after the session, and the publisher streams
        # the weights once more for it).
        # None: every engine error fails the sync.
        self.expendable: Callable[[EngineClient], bool] | None = None
        self.lost: set[str] = set()  # URLs left out of the current session
        self.paused = True  # whether the current session paused generation (begin_session)
        self.per_node = per_node
        self.push_to: set[str] | None = None  # per_node: the URLs this rank pushes buckets to (None: every engine)

    # -- pushing ---------------------------------------------------------------------------------------------------
    def begin_session(self, *, pause: bool = True) -> None:
        """Pause generation (pause=True) and open SGLang's weight-update session on every engine (once per sync, one
        caller). pause=False for a caller that knows nothing is generating (a synchronous schedule syncs between
        rollouts): two HTTP round trips less per sync.

        The pause RETRACTS the requests in flight (PAUSE_MODE; docs/weight_updates_in_flight.md): SGLang frees their
        KV and puts them back in its queue with the tokens they have, so each update's cache flush (flush_cache,
        sent with every update) succeeds and empties the radix cache of old-weight prefixes; on continue they are
        prefilled again under the new weights and go on. Every token is then sampled from a context computed by
        one set of weights, the version it is stamped with (SGLang's meta_info.weight_versions), and keeps the
        log-prob it was sampled with. An `in_place` pause keeps the old KV, which a new-weights decode would extend
        (neither policy's tokens), and SGLang refuses its flush while requests run: HTTP 400 at the first sync of
        an off-policy run. mpo's engine follows the same rules (mpo.engine.generator)."""
        self.lost = set()
        self.paused = pause
        self._each(lambda client, _: (pause and client.pause_generation(mode=PAUSE_MODE),
                                      client.begin_weight_update()))

    def end_session(self) -> None:
        """Close the session (the updates take effect) and resume generation on every engine (if begin paused it)."""
        self._each(lambda client, _: (client.end_weight_update(), self.paused and client.continue_generation()))

    @property
    def live(self) -> list[EngineClient]:
        """The engines still in the session (the ones to verify)."""
        return [c for c, _ in self._live()]

    def _live(self) -> list[tuple[EngineClient, int]]:
        """(client, TP size) of the engines still in the session."""
        return [(c, tp) for c, tp in zip(self.clients, self.tp_sizes) if c.url not in self.lost]

    def _pushed(self) -> list[tuple[EngineClient, int]]:
        """(client, TP size) of the engines still in the session that this rank pushes buckets to (push_to)."""
        return [(c, tp) for c, tp in self._live() if self.push_to is None or c.url in self.push_to]

    def _each(self, call: Callable[[EngineClient, int], Any], *, pushing: bool = False) -> None:
        """call(client, TP size) on each engine still in the session (pushing: that this rank pushes to), in turn;
        one that fails in transport and is expendable is dropped from the session."""
        for client, tp in (self._pushed() if pushing else self._live()):
            try:
                call(client, tp)
            except EngineError as exc:
                if not self._drop(client.url, exc):
                    raise

    def _drop(self, url: str, exc: BaseException) -> bool:
        """Leave the engine at `url` out of the rest of this session if it failed in transport and is expendable."""
        client = next((c for c in self.clients if c.url == url), None)
        if (client is None or self.expendable is None or not isinstance(exc, EngineError) or not exc.retryable
                or not self.expendable(client)):
            return False
        log.warning("engine %s failed during the weight update (%s); left out of it (it is restarted and gets these "
                    "weights streamed again)", url, exc)
        self.lost.add(url)
        return True

    def push_bucket(self, bucket: NamedTensors, version: int, *, wait: bool = True) -> "PendingPush | None":
        """One bucket of HF-named tensors to every engine, inside an open session (any sender may call it), tagged
        with weight `version` (on the wire str(version): SGLang's weight_version is a string).

        wait=False (shm transport; the others always wait): return once the engines were asked, with a PendingPush
        whose wait() returns when every engine has copied the bucket out; until then its memory must not change.
        The streaming sync uses this to place the next bucket while the engines read this one."""
        if self.transport == "distributed" and not self.groups:
            self.connect()
        version = str(version)
        if self.transport == "tensor":
            self._push_tensor(bucket, version)
        elif self.transport == "cuda_ipc":
            self._push_cuda_ipc(bucket, version)
        elif self.transport == "shm":
            return self._push_shm(bucket, version, wait)
        else:
            self._push_distributed(bucket, version)
        return None

    def _push_tensor(self, bucket: NamedTensors, version: str) -> None:
        # One payload per bucket: a safetensors file (mpo) or one flattened buffer of every dtype (SGLang)
        if self.engine == "mpo":
            load_format, payload = MPO_FORMAT, encode_mpo_bucket(bucket)
        else:
            load_format, payload = SGLANG_FORMAT, flattened_bucket_payload(bucket)
        self._each(lambda client, tp: client.update_weights_from_tensor([payload] * tp, load_format=load_format,
                                                                        weight_version=version), pushing=True)

    def _push_cuda_ipc(self, bucket: NamedTensors, version: str) -> None:
        """SGLang's colocated path: the bucket stays on this GPU and the engine maps it through CUDA IPC handles
        (torch's ForkingPickler reductions, as sglang's MultiprocessingSerializer writes them), one payload per
        engine TP rank. NOT RUN ON CPU (no CUDA here): GPU-only, checked on the lent GPU machine when there is one.
        The engines must run on this node's GPUs; the tensors stay alive until every engine replied."""
        if not torch.cuda.is_available():
            raise EngineError(self.clients[0].url, "/update_weights_from_tensor",
                              "sync.transport='cuda_ipc' needs CUDA (colocated engines on the trainer's GPUs)",
                              retryable=False)
        device = torch.device("cuda", torch.cuda.current_device())
        # One buffer (every dtype) per bucket: one IPC handle, one mapping on the engine side
        on_device = [(name, t.detach().to(device)) for name, t in bucket]
        payload = cuda_ipc_payload(on_device)
        torch.cuda.synchronize(device)  # the packed buffer is written before the engines map it
        for client, tp in self._pushed():
            client.update_weights_from_tensor([payload] * tp, load_format=SGLANG_FORMAT, weight_version=version)
        torch.cuda.synchronize(device)

    def _push_shm(self, bucket: NamedTensors, version: str, wait: bool) -> "PendingPush | None":
        """Same-host mpo engines read the bucket in place: locators for tensors already in a shared slot (strided
        views included: the streaming sync's q/k/v), one copy into the spill buffer for the rest (a plain list of
        tensors, as the benches push). A bucket that needed the spill buffer is always waited for (the buffer is reused
        by the next bucket)."""
        import json

        from mpo.weight_sync.shared_memory import SharedBuffer, file_name, locate, new_token

        located, missing = [], []
        for name, tensor in bucket:
            tensor = tensor.detach()
            loc = locate(name, tensor)  # None unless it lies in a shared buffer of this process (CPU)
            (located.append(loc) if loc is not None else missing.append((name, tensor)))
        if missing:
            align = 64
            sizes = [-(-t.numel() * t.element_size() // align) * align for _, t in missing]
            if self._spill is None or self._spill.numel < sum(sizes):
                if self._spill is not None:
                    self._spill.close()
                self._spill = SharedBuffer(file_name(new_token(), "spill"), max(sum(sizes), self.bucket_bytes),
                                           torch.uint8, create=True)
            at = 0
            for (name, tensor), size in zip(missing, sizes):
                nbytes = tensor.numel() * tensor.element_size()
                view = self._spill.tensor[at: at + nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor)
                located.append(locate(name, view))
                at += size
        payload = json.dumps([loc.to_json() for loc in located])
        live = self._pushed()
        tp_of = {id(c): tp for c, tp in live}
        pending = PendingPush(_Calls([c for c, _ in live], lambda client: client.update_weights_from_tensor(
            [payload] * tp_of[id(client)], load_format=SHM_FORMAT, weight_version=version)), self.timeout_s,
            self._drop)
        if wait or missing:
            pending.wait()
            return None
        return pending

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def _push_distributed(self, bucket: NamedTensors, version: str) -> None:
        """The bucket packed into one buffer (wire.pack_bucket) and broadcast ONCE per engine group; the engine
        receives it with load_format="flattened_bucket" (SGLang 0.5.23 allocates FlattenedTensorBucket.empty(names,
        dtypes, shapes) and takes one broadcast; mpo's engine the same), whatever the number of tensors."""
        flat, manifest = pack_bucket(bucket, device=self._device())  # alive until every broadcast completed
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
        # An engine that refuses before receiving (e.g. an unknown group) would leave the broadcasts waiting:
        # poll both, and fail with the engine's own error as soon as one comes back.
        deadline = time.monotonic() + self.timeout_s
        while not (calls.done() and all(w.is_completed() for w in works)):
            if calls.errors and not all(w.is_completed() for w in works):
                self.groups = []  # the groups are out of step now; the next push makes new ones
                calls.raise_first()
            if time.monotonic() > deadline:
                raise EngineError(self.clients[0].url, "/update_weights_from_distributed",
                                  f"bucket of {len(names)} tensors not done after {self.timeout_s:.0f} s")
            time.sleep(0.001)
        calls.raise_first()

    # -- the process group (distributed transport) ----------------------------------------------------------------
    def connect(self) -> None:
        """Create the weight-update group(s) (see __init__): this sender as rank 0 plus every engine's TP ranks
        (engine i from its rank offset), or one group per engine."""
        if self.group_per_engine:
            self.groups = [([c], self._join([c], [tp], f"{self.group_name}_e{i}"), f"{self.group_name}_e{i}")
                           for i, (c, tp) in enumerate(zip(self.clients, self.tp_sizes))]
        else:
            self.groups = [(list(self.clients), self._join(self.clients, self.tp_sizes, self.group_name),
                            self.group_name)]

    def _join(self, clients: Sequence[EngineClient], tp_sizes: Sequence[int], name: str
              ) -> torch.distributed.ProcessGroup:
        port = free_port()
        world_size, offsets = group_layout(tp_sizes)
        by_url = dict(zip((c.url for c in clients), offsets))
        calls = _Calls(clients, lambda c: c.init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=by_url[c.url], world_size=world_size,
            group_name=name, backend=self.backend))
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = join_weight_update_group(self.master_address, port, world_size, name,
                                                           backend=self.backend, rank=0,
                                                           timeout=timedelta(seconds=self.timeout_s))
            except BaseException as exc:  # noqa: BLE001
                joined["error"] = exc

        trainer = threading.Thread(target=join, daemon=True)
        trainer.start()
        deadline = time.monotonic() + self.timeout_s
        while trainer.is_alive() or not calls.done():
            if calls.errors:
                calls.raise_first()
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight-update group {name}: not all of {world_size} ranks joined "
                                   f"within {self.timeout_s:.0f} s")
            time.sleep(0.01)
        calls.raise_first()
        if "error" in joined:
            raise joined["error"]
        return joined["group"]

    def close(self) -> None:
        """Tear the weight-update groups down on the engines and here (distributed transport); free the shm spill."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None
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


def engine_set_sync(engines, bucket_bytes: int) -> WeightSync:
    """Rank 0's one WeightSync for an EngineSet (mpo.rollout.engines), made on first use and kept on the set (its
    distributed group, if any, is made once and reused every step; EngineSet.stop closes it). Resolves the set's
    `transport` ("auto") first."""
    if engines.sync is None:
        engines.transport = resolve_transport(engines.transport, engines.engine, started_here=bool(engines.processes),
                                              is_gpu=torch.cuda.is_available(), shared_memory=engines.shared_memory)
        sync = WeightSync(engines.clients, engine=engines.engine, transport=engines.transport,
                          bucket_bytes=bucket_bytes, tp_sizes=engines.engine_tp_sizes(),
                          master_address=engines.sync_master_address,
                          per_node=per_node_sync(engines.transport, engines.engine))
        if engines.transport != "distributed":  # a dead member would leave the group's collectives hanging
            sync.expendable = engines.exited
        engines.sync = sync
    return engines.sync
