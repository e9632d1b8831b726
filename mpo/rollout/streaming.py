"""Streaming weight sync: trainer shards -> engines bucket by bucket, with no full-model gather on any rank.

At Qwen3-30B-A3B, gathering every shard on every rank (mpo.models.full_state.gather_full_state) moves ~61 GB of
pickles per rank per step. Here every rank knows one fixed plan, built once from megatron's own sharding metadata
(each ShardedTensor's global shape and offset; the metadata, never the data, is exchanged once):

* Units: the conversion mapping's units (checkpoints_tools.mapping: one layer slice, or one (layer, expert) slice,
  of one megatron tensor, plus the HF tensors it becomes), in the mapping's fixed order.
* Senders: one rank per pipeline stage (the stage's lowest global rank, i.e. TP rank 0 / DP rank 0). A unit belongs
  to the stage whose ranks hold it; its sender assembles it.
* Pieces: the main-replica shards that intersect a unit. Each is held by exactly one rank of that stage: a TP peer
  (a column/row slice) or an EP peer (another expert block). The holder sends it point to point to the sender (on the
  training device: NCCL on GPU, gloo here); the sender receives it straight into the unit's full tensor (or a slice
  buffer for non-contiguous row slices). DP replicas send nothing.
* Buckets: consecutive units of one sender, up to `bucket_bytes` of HF tensors (a larger unit gets its own). The
  sender maps each unit to HF names and layouts (ModelMapping.to_hf) and pushes the bucket to every engine
  (WeightSync.push_bucket), then reuses its memory. A sender allocates two slots per sync (each the largest
  bucket's megatron tensors plus landing buffers for non-contiguous slices) and carves every unit out of them:
  receives for bucket k+1 land in one slot while bucket k is converted and pushed from the other (double buffering,
  so the gathers overlap the push). Holders send views of their parameters and keep at most two buckets of sends in
  flight. Peak extra memory on any rank is therefore two slots plus the conversion/transport copies of one bucket,
  whatever the model size (measured: `python -m mpo.bench weight_sync --sweep`).

Same-host pieces on CPU (`host_shared_memory`, default: on when the training device is the CPU): gloo's only path
between two processes of one host is TCP over loopback, several times slower than memcpy, so there the sender's
slots are shared-memory files (mpo.rollout.shared_memory) and a holder on the sender's host writes its pieces
straight into place (strided where the place is not contiguous: no landing buffer), told by a small "go" message
when the slot is free and answering "done". Holders on other hosts, and every holder on GPU (NCCL, NVLink), send as
above. A slot in shared memory also lets same-host mpo engines read the bucket in place (rollout.sync=shm).

Why one sender per stage that talks to the engines itself, rather than forwarding to rank 0: at 32 GPUs with PP4 the
stages' bytes then leave from four NICs instead of converging on one, and no rank ever holds more than its buckets.
The cost is that every sender is an engine client: HTTP senders push concurrently (each request stands alone);
"distributed" senders each make their own weight-update group with the engines (SGLang keys groups by name) and push
one stage after the other, because an engine serves one collective at a time and two stages' broadcasts interleaved
differently on two engines would deadlock.

Weight-update session: rank 0 opens it on every engine (pause, begin) before any bucket and closes it (end,
continue) after every sender finished, so the new weights take effect at once.

Verification: mpo's engine reports sha256 over (name, per-tensor sha256) in name order (mpo.rollout.weight_sync.
combine_digests). Each sender hashes the tensors it pushed (as the engine stores them: engine dtype); only the
name -> digest map (a few bytes per tensor) is gathered to rank 0, which compares the combined checksum with every
engine's. SGLang engines are verified by the covering probe (mpo.trainer.loop), which needs no weights at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


Box = tuple[tuple[int, int], ...]  # per-axis [start, stop) in global coordinates


@dataclass(frozen=True)
class ShardMeta:
    """One main-replica shard of one rank: what megatron's ShardedTensor says about it (no data).

    Attributes:
        key: torch_dist key.
        global_shape: full shape (stacked layer / expert axes first).
        offset: global offset on every axis.
        shape: the local tensor's shape (the trailing axes; leading stacked axes have size 1 and are absent).
    """

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def box(self) -> Box:
        prepend = len(self.global_shape) - len(self.shape)
        sizes = (1,) * prepend + self.shape
        return tuple((o, o + n) for o, n in zip(self.offset, sizes))


@dataclass(frozen=True)
class Piece:
    """The part of one holder's shard that falls in one unit.

    Attributes:
        holder: global rank that holds it.
        shard: index of the shard in the holder's shard list.
        src: the slice of the holder's local tensor (trailing axes).
        dst: the slice of the unit's tensor (the unit's own axes, i.e. without its stacked index).
    """

    holder: int
    shard: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


@dataclass(frozen=True)
class PlannedUnit:
    """One mapping unit as the streaming plan places it."""

    unit: Any  # checkpoints_tools.mapping.Unit
    key: str  # the megatron key actually present in the model (local or TE spec)
    shape: tuple[int, ...]  # the unit's tensor shape at this layout (vocab rows padded as the model pads them)
    sender: int
    pieces: tuple[Piece, ...]
    nbytes: int  # bytes of its HF tensors


@dataclass
class Bucket:
    sender: int
    units: list[PlannedUnit] = field(default_factory=list)
    nbytes: int = 0
    layouts: dict = field(default_factory=dict, repr=False, compare=False)  # _slot_layout's, computed once


def local_shards(model: torch.nn.Module) -> tuple[list[ShardMeta], list[torch.Tensor]]:
    """This rank's main-replica shards (metadata, and the live tensors: views of the parameters, no copies)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    metas, tensors = [], []
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor) and is_main_replica(item.replica_id):
            if item.flattened_range is not None:
                raise NotImplementedError(f"{item.key}: flattened (distributed-optimizer) shards are not supported")
            metas.append(ShardMeta(item.key, tuple(item.global_shape), tuple(item.global_offset),
                                   tuple(item.data.shape)))
            tensors.append(item.data.detach())
    return metas, tensors


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def build_plan(mapping, shards_by_rank: Sequence[Sequence[ShardMeta]], stage_of_rank: Sequence[int],
               bucket_bytes: int, dtype_bytes: int) -> tuple[list[PlannedUnit], list[Bucket]]:
    """The plan every rank computes identically from the same gathered metadata: units in mapping order, with their
    pieces and sender, grouped into per-sender buckets of at most bucket_bytes (a larger unit gets its own)."""
    from checkpoints_tools.errors import ConversionError

    by_key: dict[str, list[tuple[int, int, ShardMeta]]] = {}
    for rank, metas in enumerate(shards_by_rank):
        for index, meta in enumerate(metas):
            by_key.setdefault(meta.key, []).append((rank, index, meta))
    sender_of_stage: dict[int, int] = {}
    for rank, stage in enumerate(stage_of_rank):
        sender_of_stage.setdefault(stage, rank)  # the lowest global rank of the stage
    planned: list[PlannedUnit] = []
    for unit in mapping.units():
        key = next((k for k in (*unit.keys, unit.rule.key, unit.rule.te_key) if k is not None and k in by_key), None)
        if key is None:
            raise ConversionError("the model has no shard for this tensor", tensor=unit.keys[0])
        holders = by_key[key]
        global_shape = holders[0][2].global_shape
        k = len(unit.index)
        unit_box = tuple((i, i + 1) for i in unit.index) + tuple((0, n) for n in global_shape[k:])
        pieces = []
        for rank, index, meta in holders:
            box = meta.box
            inter = _intersect(box, unit_box)
            if inter is None:
                continue
            prepend = len(global_shape) - len(meta.shape)
            src = tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(inter[prepend:], box[prepend:]))
            dst = tuple(slice(lo, hi) for lo, hi in inter[k:])
            extra = k - prepend  # > 0: the shard spans several units on a stacked axis; index the unit's position
            if extra > 0:
                src = tuple(s.start if i < extra else s for i, s in enumerate(src))
            pieces.append(Piece(rank, index, src, dst))
        shape = tuple(global_shape[k:])
        covered = sum(torch.Size([s.stop - s.start for s in p.dst]).numel() for p in pieces)
        if covered != torch.Size(shape).numel():
            raise ConversionError(f"main-replica shards cover {covered} of {torch.Size(shape).numel()} elements of "
                                  f"unit {unit.index}", tensor=key)
        sender = sender_of_stage[stage_of_rank[min(p.holder for p in pieces)]]
        nbytes = sum(torch.Size(s).numel() for s in unit.rule.hf_shapes) * dtype_bytes
        planned.append(PlannedUnit(unit, key, shape, sender, tuple(pieces), nbytes))
    buckets: list[Bucket] = []
    open_bucket: dict[int, Bucket] = {}
    for pu in planned:
        bucket = open_bucket.get(pu.sender)
        if bucket is None or (bucket.units and bucket.nbytes + pu.nbytes > bucket_bytes):
            bucket = open_bucket[pu.sender] = Bucket(pu.sender)
            buckets.append(bucket)
        bucket.units.append(pu)
        bucket.nbytes += pu.nbytes
    return planned, buckets


def _numel(shape: Sequence[int]) -> int:
    return torch.Size(shape).numel()


def _holders(bucket: Bucket) -> list[int]:
    """The ranks other than the sender that hold a piece of the bucket, in rank order."""
    return sorted({p.holder for pu in bucket.units for p in pu.pieces if p.holder != bucket.sender})


def _slot_layout(bucket: Bucket, in_place: frozenset[int]) -> tuple[list[int], dict[tuple[int, int], int], int]:
    """Where a bucket lies in its sender's slot, in elements (sender and same-host holders compute it alike): each
    unit's tensor, then, for each piece received over the process group whose place in the unit is not contiguous
    (e.g. a row-parallel slice), a landing buffer. Pieces written in place (the sender's own; same-host holders'
    through shared memory, `in_place`) need none. Returns (unit offsets, {(unit, piece): landing offset}, total).
    Fixed by the plan: computed once per bucket and kept."""
    if in_place in bucket.layouts:
        return bucket.layouts[in_place]
    offsets, landing, used = [], {}, 0
    for u, pu in enumerate(bucket.units):
        offsets.append(used)
        used += _numel(pu.shape)
        probe = torch.empty(pu.shape, device="meta")
        for j, piece in enumerate(pu.pieces):
            if piece.holder == bucket.sender or piece.holder in in_place:
                continue
            target = probe[piece.dst]
            if not target.is_contiguous():
                landing[(u, j)] = used
                used += _numel(target.shape)
    bucket.layouts[in_place] = (offsets, landing, used)
    return offsets, landing, used


def _place(target: torch.Tensor, local: list[torch.Tensor], piece: Piece) -> None:
    """Copy a piece this process holds into its place in the unit (the sender's own, or a same-host holder's)."""
    target.copy_(local[piece.shard][piece.src].reshape(target.shape))


def _unit_views(bucket: Bucket, slot: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    return [slot[o: o + _numel(pu.shape)].view(pu.shape) for pu, o in zip(bucket.units, offsets)]


class _Gather:
    """The in-flight receives of one bucket on its sender: unit tensors carved out of one preallocated slot (so a
    sync allocates two slots, not a tensor per unit), filled by irecv straight into place where contiguous, and by
    same-host holders writing into the shared slot themselves (`in_place`: a go message out, a done message back)."""

    def __init__(self, bucket: Bucket, index: int, local: list[torch.Tensor], slot: torch.Tensor,
                 in_place: frozenset[int]) -> None:
        self.bucket, self.works, self.copies, self.local = bucket, [], [], local
        offsets, landing, _ = _slot_layout(bucket, in_place)
        self.tensors = _unit_views(bucket, slot, offsets)
        self.own: list[tuple[torch.Tensor, Piece]] = []  # the sender's own pieces, placed by place_own()
        go = torch.tensor([index], dtype=torch.int64)
        self._tokens = [go]  # alive until the sends completed
        shared = [h for h in _holders(bucket) if h in in_place]
        for holder in shared:  # the slot is free: same-host holders may write now
            self.works.append(dist.isend(go, dst=holder))
        for u, (pu, full) in enumerate(zip(bucket.units, self.tensors)):
            for j, piece in enumerate(pu.pieces):
                target = full[piece.dst]
                if piece.holder == bucket.sender:
                    self.own.append((target, piece))
                elif piece.holder in in_place:
                    continue
                elif (u, j) in landing:  # received whole, placed after
                    at = landing[(u, j)]
                    buffer = slot[at: at + target.numel()].view(target.shape)
                    self.works.append(dist.irecv(buffer, src=piece.holder))
                    self.copies.append((target, buffer))
                else:
                    self.works.append(dist.irecv(target, src=piece.holder))
        for holder in shared:
            done = torch.empty(1, dtype=torch.int64)
            self._tokens.append(done)
            self.works.append(dist.irecv(done, src=holder))

    def place_own(self) -> None:
        """Copy the sender's own pieces into place (apart from __init__, so that it can run while the engines read
        the previous bucket)."""
        for target, piece in self.own:
            _place(target, self.local, piece)
        self.own = []

    def wait(self) -> list[torch.Tensor]:
        self.place_own()
        for work in self.works:
            work.wait()
        for target, buffer in self.copies:
            target.copy_(buffer)
        self.works, self.copies, self._tokens = [], [], []
        return self.tensors


def _write_pieces(bucket: Bucket, rank: int, local: list[torch.Tensor], slot: torch.Tensor,
                  in_place: frozenset[int]) -> None:
    """A same-host holder's pieces of one bucket, written straight into the sender's shared slot."""
    offsets, _, _ = _slot_layout(bucket, in_place)
    for pu, full in zip(bucket.units, _unit_views(bucket, slot, offsets)):
        for piece in pu.pieces:
            if piece.holder == rank:
                _place(full[piece.dst], local, piece)


def _send_pieces(bucket: Bucket, rank: int, local: list[torch.Tensor]) -> list:
    """A holder's sends of one bucket to its sender (views of the parameters where contiguous: no copy)."""
    works = []
    for pu in bucket.units:
        for piece in pu.pieces:
            if piece.holder == rank and bucket.sender != rank:
                works.append(dist.isend(local[piece.shard][piece.src].contiguous(), dst=bucket.sender))
    return works


@dataclass
class StreamResult:
    """What one rank did in one streaming sync."""

    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0
    digests: dict[str, str] = field(default_factory=dict)
    gather_s: float = 0.0  # a sender's wait for its pieces (what double buffering did not hide)
    push_s: float = 0.0  # a sender's time in push() and waiting for the engines to finish reading its buckets


class WeightStreamer:
    """One rank's side of the streaming sync (every rank of the trainer world makes one and calls stream()).

    Args:
        model: the unwrapped megatron GPTModel (one pipeline chunk).
        mapping: the conversion mapping (checkpoints_tools.mapping.mapping_for(cfg, spec="local")).
        stage: this rank's pipeline stage.
        bucket_bytes: bucket size (HF bytes).
        device: where pieces are gathered (the training device).
        host_shared_memory: same-host pieces through shared-memory slots (module docstring); None: on when the
            device is the CPU.
    """

    def __init__(self, model: torch.nn.Module, mapping, *, stage: int, bucket_bytes: int,
                 device: torch.device | str = "cpu", host_shared_memory: bool | None = None) -> None:
        import os

        from mpo.rollout.shared_memory import host_key, new_token

        self.model, self.mapping, self.bucket_bytes = model, mapping, bucket_bytes
        self.device = torch.device(device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.shared = self.device.type == "cpu" if host_shared_memory is None else host_shared_memory
        if self.shared and self.device.type != "cpu":
            raise ValueError("host_shared_memory needs the CPU as the gather device (on GPU pieces move over NCCL)")
        metas, tensors = local_shards(model)
        gathered: list = [None] * self.world
        # A rank may hold no main copy at all (pure data parallelism: every rank but the first holds replicas); it
        # still takes part in the collectives below, and the slots' dtype comes from a rank that holds shards.
        mine = (stage, metas, host_key() if self.shared else f"rank{self.rank}", os.getpid(), new_token(),
                tensors[0].dtype if tensors else None)
        dist.all_gather_object(gathered, mine)  # metadata only, once
        self.dtype = next(g[5] for g in gathered if g[5] is not None)
        self.stage_of_rank = [g[0] for g in gathered]
        self.host_of_rank = [g[2] for g in gathered]
        self.pid_of_rank = [g[3] for g in gathered]
        self.token = gathered[0][4]  # rank 0's: one name space for this streamer's files
        self._local, self._local_key = tensors, self._params_key()
        self.syncs = 0  # counts stream() calls (every rank alike): a sync's slot files have their own names
        self.units, self.buckets = build_plan(mapping, [g[1] for g in gathered], self.stage_of_rank, bucket_bytes,
                                              torch.empty((), dtype=self.dtype).element_size())
        self.senders = sorted({b.sender for b in self.buckets})
        self.hf_shapes = mapping.hf_shapes()
        self.stage = stage

    @property
    def is_sender(self) -> bool:
        return self.rank in self.senders

    def _params_key(self) -> tuple:
        # The storage's identity (its StorageImpl) and the place in it, not the data address: the trainer's offload
        # (mpo.trainer.offload) frees and reallocates storages in place every colocated step, which moves the
        # address but keeps every view valid; only a re-seated parameter (a new storage) needs new views.
        return tuple((p.untyped_storage()._cdata, p.storage_offset(), tuple(p.shape)) for p in self.model.parameters())

    def in_place(self, sender: int) -> frozenset[int]:
        """The ranks that write their pieces straight into `sender`'s shared slots (same host; none without
        host_shared_memory)."""
        if not self.shared:
            return frozenset()
        return frozenset(r for r in range(self.world) if r != sender and self.host_of_rank[r] == self.host_of_rank[sender])

    def _slot_name(self, sender: int, index: int) -> str:
        from mpo.rollout.shared_memory import file_name

        return file_name(self.token, self.syncs, f"r{sender}", index, pid=self.pid_of_rank[sender])

    def stream(self, push: Callable[[list[tuple[str, torch.Tensor]]], Any] | None, *, sequential: bool,
               digest: Callable[[str, torch.Tensor], str] | None = None, hf_views: bool = False) -> StreamResult:
        """Collective over the trainer world: every bucket to its sender, which converts it to HF names and calls
        push(bucket) (None: gather and convert only, e.g. a sender with no engines). push may return an object
        with wait() (WeightSync.push_bucket(wait=False)): the bucket's slot is reused only after it returned, so the
        sender places the next bucket while the engines read this one. sequential: stages push one after the other
        (distributed transport), else concurrently. digest(name, tensor): per-tensor digests to collect (mpo engine
        verification). hf_views: push gets views of the slot with no conversion copies (ModelMapping.to_hf(views=
        True): q/k/v keep their head-group axis), for a push that reads strided memory (the shm transport)."""
        started = time.perf_counter()
        key = self._params_key()
        if key != self._local_key:  # a parameter was re-seated (not just written in place): views anew
            self._local, self._local_key = local_shards(self.model)[1], key
        local = self._local  # megatron's sharded_state_dict() per sync cost a tenth of a second at 12 layers
        result = StreamResult()
        order = sorted(set(self.stage_of_rank)) if sequential else [None]
        for turn in order:
            if turn is None or turn == self.stage:
                mine = [b for b in self.buckets if self.stage_of_rank[b.sender] == self.stage]
                if self.is_sender:
                    self._send_buckets(mine, local, push, digest, result, hf_views)
                else:
                    self._hold_buckets(mine, local)
            if turn is not None and len(order) > 1:
                dist.barrier()
        self.syncs += 1
        result.seconds = time.perf_counter() - started
        return result

    def _send_buckets(self, buckets: list[Bucket], local, push, digest, result: StreamResult,
                      hf_views: bool) -> None:
        if not buckets:
            return
        # Two slots, allocated once per sync: bucket k is converted and pushed from one while bucket k+1's receives
        # land in the other (double buffering), so the gathers overlap the push and memory stays two buckets.
        in_place = self.in_place(self.rank)
        numel = max(_slot_layout(b, in_place)[2] for b in buckets)
        count = min(2, len(buckets))
        if self.shared:
            from mpo.rollout.shared_memory import SharedBuffer

            shared = [SharedBuffer(self._slot_name(self.rank, i), numel, self.dtype, create=True) for i in range(count)]
            slots = [buffer.tensor for buffer in shared]
        else:
            shared, slots = [], [torch.empty(numel, dtype=self.dtype, device=self.device) for _ in range(count)]
        try:
            self._push_from_slots(buckets, local, slots, in_place, push, digest, result, hf_views)
        finally:
            del slots
            for buffer in shared:  # holders are done with them (their done messages arrived): unlink
                buffer.close()

    def _push_from_slots(self, buckets: list[Bucket], local, slots: list[torch.Tensor], in_place: frozenset[int],
                         push, digest, result: StreamResult, hf_views: bool) -> None:
        reading: list = [None] * len(slots)  # per slot: the engines' read of the bucket pushed from it, if pending

        def settle(slot: int) -> None:  # the engines are done with this slot (it may be written again)
            if reading[slot] is not None:
                began = time.perf_counter()
                ticket, reading[slot] = reading[slot], None
                ticket.wait()
                result.push_s += time.perf_counter() - began

        try:
            pending = _Gather(buckets[0], 0, local, slots[0], in_place)
            for k, bucket in enumerate(buckets):
                began = time.perf_counter()
                tensors = pending.wait()
                result.gather_s += time.perf_counter() - began
                pending = None
                if k + 1 < len(buckets):  # bucket k+1's receives and go messages now; its own pieces after the push
                    settle((k + 1) % 2)
                    pending = _Gather(buckets[k + 1], k + 1, local, slots[(k + 1) % 2], in_place)
                named: list[tuple[str, torch.Tensor]] = []
                for pu, tensor in zip(bucket.units, tensors):
                    named += self.mapping.to_hf(pu.unit, tensor, views=hf_views)
                if digest is not None:
                    result.digests.update((name, digest(name, t)) for name, t in named)
                if push is not None:
                    began = time.perf_counter()
                    ticket = push(named)
                    result.push_s += time.perf_counter() - began
                    if ticket is not None:
                        reading[k % 2] = ticket
                if pending is not None:
                    pending.place_own()  # while the engines copy bucket k out of the other slot
                result.bytes += sum(t.numel() * t.element_size() for _, t in named)
                result.buckets += 1
                del named, tensors
        except BaseException:  # never free a slot an engine may still be reading; the first error is the one raised
            for slot in range(len(slots)):
                try:
                    settle(slot)
                except Exception:  # noqa: BLE001, S110 - an engine failing the same sync again says nothing new
                    pass
            raise
        for slot in range(len(slots)):
            settle(slot)

    def _hold_buckets(self, buckets: list[Bucket], local) -> None:
        previous: list = []
        mapped: dict[int, Any] = {}  # slot index -> the sender's shared slot, mapped on first use
        try:
            for k, bucket in enumerate(buckets):
                if self.rank not in _holders(bucket):
                    continue
                in_place = self.in_place(bucket.sender)
                if self.rank in in_place:  # wait until the slot is free, write in place, say so
                    go = torch.empty(1, dtype=torch.int64)
                    dist.recv(go, src=bucket.sender)
                    if int(go) != k:
                        raise RuntimeError(f"streaming sync out of step: rank {self.rank} expected bucket {k}, "
                                           f"sender {bucket.sender} announced {int(go)}")
                    if k % 2 not in mapped:
                        from mpo.rollout.shared_memory import SharedBuffer

                        mapped[k % 2] = SharedBuffer(self._slot_name(bucket.sender, k % 2), None, self.dtype,
                                                     create=False)
                    _write_pieces(bucket, self.rank, local, mapped[k % 2].tensor, in_place)
                    dist.send(go, dst=bucket.sender)
                    continue
                current = _send_pieces(bucket, self.rank, local)
                for work in previous:  # at most two buckets of sends in flight
                    work.wait()
                previous = current
            for work in previous:
                work.wait()
        finally:
            for buffer in mapped.values():
                buffer.close()


def routable_address(peer_host: str) -> str:
    """This host's address on the route to peer_host (what a peer should dial to reach us): the source address the
    kernel picks for a UDP 'connection' to it (no packet is sent). Loopback for a loopback peer."""
    import socket

    from mpo.parallel.ports import is_loopback

    if is_loopback(peer_host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in peer_host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host.strip("[]"), 9))
        return probe.getsockname()[0]
