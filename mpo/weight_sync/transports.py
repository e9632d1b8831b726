"""The transports (see mpo.weight_sync). The one compatibility check, `check_transport`, is asked by config
validation, the launcher's placement and WeightSync on every sender. "auto" is a resolution rule (resolve_transport),
not a transport.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Sequence

import torch

from mpo.registry import PLUGIN_FORMS, Registry
from mpo.rollout.client import EngineClient, EngineError

if TYPE_CHECKING:
    from mpo.config import SyncSection

NamedTensors = list[tuple[str, torch.Tensor]]
EngineKind = Literal["mpo", "sglang"]


class Transport:
    """One way a bucket reaches the engines of one WeightSync session (`session`: its engines, TP sizes, timeouts and
    the engines still in it). A subclass sets the class attributes, implements `push`, and overrides `connect` /
    `close` / `prepare` when it keeps state across buckets (a process group, a spill buffer).

    Class attributes (what it can reach; read by the config check, the launcher's placement, the plan and the
    publisher, before any instance exists):
        what: what it is, in a user's words (error messages).
        engines: the engine kinds it serves ("mpo", "sglang").
        same_host: those of them that must run on the trainer's node to be reached this way (a colocated run over
            several trainer nodes then routes buckets per node: mpo.weight_sync.relay).
        in_place: the engines read a bucket in place from this host's shared memory: the streamer hands strided views
            of its slots (no conversion copies) and a relaying node leader receives into a shared file.
        drops_dead_engines: an engine whose process died may be left out of the rest of a session (False where a
            dead member would leave the other members' collectives hanging).
        call_unit: what one call of a sync is (the plan's "per sync" line).
    """

    what: ClassVar[str] = "a user's transport"
    engines: ClassVar[tuple[str, ...]] = ()
    same_host: ClassVar[tuple[str, ...]] = ()
    in_place: ClassVar[bool] = False
    drops_dead_engines: ClassVar[bool] = True
    call_unit: ClassVar[str] = "HTTP payloads"

    def __init__(self, session: WeightSync) -> None:
        self.session = session
        self.collectives = 0  # collectives this transport issued (the sync's shape, for benches and tests)

    # -- what it can reach (class level) ---------------------------------------------------------------------------
    @classmethod
    def check_colocated(cls, engine: str) -> None:
        """Raise ValueError (one line) when engines of kind `engine` on the trainer's own GPUs cannot be reached."""

    @classmethod
    def stages_at_once(cls, senders: int, engines: int) -> bool:
        """Whether the pipeline stages' senders push at once (else they take turns)."""
        return True

    @classmethod
    def link_copies(cls, engines: int, tp: int, at_once: bool) -> float:
        """Bytes on a sender's link per byte of its stage (mpo.memory_plan.sync_shape): 0 for a path that copies
        nothing over a link."""
        return 0.0

    @classmethod
    def calls_per_bucket(cls, engines: int, at_once: bool) -> int:
        """Engine-side calls (payloads, handles, collectives) one bucket costs."""
        return engines

    @classmethod
    def groups_per_engine_gpu(cls, senders: int) -> int:
        """Process groups each engine GPU joins (0: the transport makes none)."""
        return 0

    # -- one session's connection (instance level) -----------------------------------------------------------------
    def check_session(self) -> None:
        """Raise ValueError (one line) when this session's engines cannot be reached this way (made on every
        sender); the kinds and nodes are already checked (check_transport)."""

    def prepare(self, at_once: bool) -> None:
        """Told before the first push whether the stages push at once (stages_at_once, the same on every rank)."""

    def connect(self) -> None:
        """Set up what the pushes need (made lazily by the first push where there is something to set up)."""

    def push(self, bucket: NamedTensors, version: str, *, wait: bool) -> PendingPush | None:
        """One bucket of HF-named tensors to every engine this rank pushes to (session.pushed()), tagged with weight
        `version`. wait=False may return a PendingPush whose wait() returns when every engine copied the bucket out
        (until then its memory must not change); None once the engines have it."""
        raise NotImplementedError(f"{type(self).__name__} must implement push(bucket, version, wait=...)")

    def close(self) -> None:
        """Release what connect / push kept (groups on the engines and here, buffers)."""


def _as_transport(name: str, obj: Any) -> type[Transport]:
    """A registry entry: a Transport subclass (a plug-in names the class itself)."""
    if not (isinstance(obj, type) and issubclass(obj, Transport)):
        raise ValueError(f"sync.transport={name!r} is {obj!r}, not a subclass of mpo.weight_sync.transports.Transport")
    if not obj.engines:
        raise ValueError(f"sync.transport={name!r}: {obj.__name__}.engines names no engine kind ('mpo', 'sglang')")
    return obj


TRANSPORTS: Registry[type[Transport]] = Registry(
    "transport", adapt=_as_transport,
    builtins=("mpo.weight_sync.transport_tensor", "mpo.weight_sync.transport_distributed",
              "mpo.weight_sync.transport_cuda_ipc", "mpo.weight_sync.transport_shm"))


def transport_class(transport: str) -> type[Transport]:
    """The class `sync.transport` names ("auto" read as "tensor", what it is for engines a run does not start
    itself); ValueError (one line) listing the valid values for a name that is neither a built-in nor a plug-in."""
    name = "tensor" if transport == "auto" else transport
    if not isinstance(name, str) or (name not in TRANSPORTS and not (":" in name and all(name.rpartition(":")[::2]))):
        raise ValueError(f"sync.transport={transport!r}; valid values: 'auto', "
                         f"{', '.join(map(repr, TRANSPORTS.names()))}, or a transport class as {PLUGIN_FORMS}")
    return TRANSPORTS.get(name)


def resolve_transport(transport: str, engine: str, *, started_here: bool, is_gpu: bool,
                      shared_memory: bool | None = None) -> str:
    """The transport `sync.transport` names; "auto" (the default) is "shm" for mpo engines this run starts on a CPU
    host (buckets read in place: a faster sync, the same learning) unless `sync.host_shared_memory` is false
    (`shared_memory`: a container with a tiny /dev/shm), and "tensor" for every other engine (engines on other nodes
    that "tensor" cannot reach need "distributed", which the recipes and the launcher's placement checks name)."""
    if transport != "auto":
        return transport
    return "shm" if engine == "mpo" and started_here and not is_gpu and shared_memory is not False else "tensor"


def check_transport(transport: str, engine: str, *, off_host: str | None = None) -> None:
    """Raise ValueError (one line, naming sync.transport) unless `transport` serves `engine` engines; `off_host`
    describes an engine that is not on the trainer's host (node), if there is one. "auto" is checked as what it is
    for engines a run does not start itself: "tensor"."""
    spec = transport_class(transport)
    if engine not in spec.engines:
        takes = [repr(name) for name, t in TRANSPORTS.items() if engine in t.engines]
        raise ValueError(f"sync.transport={transport!r} is {spec.what}; rollout.engine={engine!r} takes "
                         f"{', '.join(takes[:-1])} or {takes[-1]}")
    if off_host is not None and engine in spec.same_host:
        raise ValueError(f"sync.transport={transport!r} is for {engine} engines on the trainer's node; {off_host}: set "
                         f"sync.transport='distributed'")


NODE_GPUS = 8  # GPUs of a node where no allocation is known (check-config, mpo plan): H100 / H200 nodes


def same_host(transport: str, engine: str) -> bool:
    """Whether `transport` reaches `engine` engines only from their own node ("auto" as check_transport reads it):
    such a sync is routed per node (mpo.weight_sync.relay)."""
    try:
        spec = transport_class(transport)
    except ValueError:
        return False
    return engine in spec.same_host


def per_node_sync(transport: str, engine: str) -> bool:
    """Whether this rank's sync routes buckets per node (mpo.weight_sync.relay): a same-host transport in a run the
    launcher placed on several trainer nodes with engines on them (it sets MPO_NODE_HOST exactly then). Elsewhere an
    engine off this host is refused up front, as check_transport says."""
    import os

    from mpo.weight_sync.relay import NODE_HOST_ENV

    return same_host(transport, engine) and bool(os.environ.get(NODE_HOST_ENV))


log = logging.getLogger(__name__)

# How a sync pauses engines with requests in flight (SGLang's pause_generation modes): "retract" sends them back to
# the queue, to be recomputed under the new weights (WeightSync.begin_session says why not "in_place" or "abort").
PAUSE_MODE = "retract"


class _Calls:
    """HTTP calls to several engines in threads, so the trainer can take part in a collective meanwhile."""

    def __init__(self, clients: Sequence[EngineClient], call: Callable[[EngineClient], Any]) -> None:
        self.errors: dict[str, BaseException] = {}
        # set once every call returned or one failed: a caller reacting to the first refusal blocks on it, not polling
        self.settled = threading.Event()
        self._left, self._lock = len(clients), threading.Lock()
        if not clients:
            self.settled.set()
        self.threads = [threading.Thread(target=self._run, args=(client, call), daemon=True) for client in clients]
        for thread in self.threads:
            thread.start()

    def _run(self, client: EngineClient, call: Callable[[EngineClient], Any]) -> None:
        try:
            call(client)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.errors[client.url] = exc
        finally:
            with self._lock:
                self._left -= 1
                if self._left == 0 or self.errors:
                    self.settled.set()

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
    """One weight-update session's engines (all of one kind) and the transport that pushes to them: pauses and opens
    SGLang's weight-update session (pause -> begin -> buckets -> end -> continue), hands each bucket to the transport
    (`via`, the class TRANSPORTS names), drops engines that died when they are expendable, closes.

    Args:
        clients: the engines (all of `engine` kind).
        engine: "mpo" or "sglang": picks the tensor-path payload and the verification.
        transport: a TRANSPORTS name (or a plug-in's `module:attr`).
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

        from mpo.parallel.ports import is_local_host

        if engine not in ("mpo", "sglang"):
            raise ValueError(f"engine must be 'mpo' or 'sglang', got {engine!r}")
        hosts = {c.url: urlsplit(c.url).hostname or "" for c in clients}
        remote = next((url for url, host in hosts.items() if not is_local_host(host)), None)
        check_transport(transport, engine,
                        off_host=None if per_node else remote and f"engine {remote} is on another node")
        self.clients = list(clients)
        self.engine, self.transport, self.bucket_bytes = engine, transport, bucket_bytes
        self.tp_sizes = list(tp_sizes or [1] * len(self.clients))
        if len(self.tp_sizes) != len(self.clients):
            raise ValueError(f"{len(self.tp_sizes)} tp_sizes for {len(self.clients)} engines")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address, self.timeout_s = master_address, timeout_s
        # expendable(client): whether that engine, having failed a call, may be left out of the rest of the session
        # (EngineSet.exited, set by engine_set_sync where the transport allows it); None: every error fails the sync.
        self.expendable: Callable[[EngineClient], bool] | None = None
        self.lost: set[str] = set()  # URLs left out of the current session
        self.paused = True  # whether the current session paused generation (begin_session)
        self.per_node = per_node
        self.push_to: set[str] | None = None  # per_node: the URLs this rank pushes buckets to (None: every engine)
        self.via: Transport = TRANSPORTS.get(transport)(self)
        self.via.check_session()

    @property
    def collectives(self) -> int:
        return self.via.collectives

    # -- pushing ---------------------------------------------------------------------------------------------------
    def begin_session(self, *, pause: bool = True) -> None:
        """Pause generation (pause=True) and open SGLang's weight-update session on every engine (once per sync, one
        caller). pause=False for a caller that knows nothing is generating (a synchronous schedule syncs between
        rollouts): two HTTP round trips less per sync.

        The pause RETRACTS the requests in flight (PAUSE_MODE; docs/weight_updates_in_flight.md): they are prefilled
        again under the new weights on continue, so every token is sampled from a context computed by one set of
        weights, the version it is stamped with. An `in_place` pause keeps the old KV, which a new-weights decode
        would extend (neither policy's tokens), and SGLang refuses its cache flush while requests run: HTTP 400 at
        the first sync of an off-policy run. mpo's engine follows the same rules (mpo.engine.generator)."""
        self.lost = set()
        self.paused = pause
        self._each(lambda client, _: (pause and client.pause_generation(mode=PAUSE_MODE), client.begin_weight_update()))

    def end_session(self) -> None:
        """Close the session (the updates take effect) and resume generation on every engine (if begin paused it)."""
        self._each(lambda client, _: (client.end_weight_update(), self.paused and client.continue_generation()))

    @property
    def live(self) -> list[EngineClient]:
        """The engines still in the session (the ones to verify)."""
        return [c for c, _ in self._live()]

    def _live(self) -> list[tuple[EngineClient, int]]:
        return [(c, tp) for c, tp in zip(self.clients, self.tp_sizes) if c.url not in self.lost]

    def pushed(self) -> list[tuple[EngineClient, int]]:
        """(client, TP size) of the engines still in the session that this rank pushes buckets to (push_to)."""
        return [(c, tp) for c, tp in self._live() if self.push_to is None or c.url in self.push_to]

    def _each(self, call: Callable[[EngineClient, int], Any], *, pushing: bool = False) -> None:
        """call(client, TP size) on each engine still in the session (pushing: that this rank pushes to), in turn;
        one that fails in transport and is expendable is dropped from the session."""
        for client, tp in (self.pushed() if pushing else self._live()):
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

    def push_bucket(self, bucket: NamedTensors, version: int, *, wait: bool = True) -> PendingPush | None:
        """One bucket of HF-named tensors to every engine, inside an open session (any sender may call it), tagged
        with weight `version` (on the wire str(version): SGLang's weight_version is a string).

        wait=False: the transport may return once the engines were asked (shm: the others always wait), with a
        PendingPush whose wait() returns when every engine has copied the bucket out; until then its memory must
        not change. The streaming sync uses this to place the next bucket while the engines read this one."""
        return self.via.push(bucket, str(version), wait=wait)

    def connect(self) -> None:
        """Set up the transport's connection now (distributed: the weight-update groups), not at the first push."""
        self.via.connect()

    def close(self) -> None:
        self.via.close()


def engine_set_sync(engines, section: SyncSection) -> WeightSync:
    """Rank 0's WeightSync for an EngineSet (mpo.rollout.engines) and the run's sync section: its transport resolved
    ("auto": shm for engines this run started on a CPU host), its engines' TP sizes asked, engines that died made
    expendable where the transport allows it. The caller owns it (mpo.weight_sync.publisher.Publisher: made once, its
    distributed group reused every step, closed with the publisher)."""
    transport = resolve_transport(section.transport, engines.engine, started_here=bool(engines.processes),
                                  is_gpu=torch.cuda.is_available(), shared_memory=section.host_shared_memory)
    sync = WeightSync(engines.clients, engine=engines.engine, transport=transport,
                      bucket_bytes=section.bucket_bytes, tp_sizes=engines.engine_tp_sizes(),
                      master_address=section.master_address or "127.0.0.1",
                      per_node=per_node_sync(transport, engines.engine))
    if sync.via.drops_dead_engines:
        sync.expendable = engines.exited
    return sync
