"""The gather: every rank's side of a streaming sync (mpo.weight_sync says how: holders' pieces to their stage's
sender, or into its shared slot on the same CPU host; two slots on the sender, double buffered)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from mpo.weight_sync.plan import Bucket, Piece, _holders, _numel, _slot_layout, build_plan, local_shards
from mpo.weight_sync.shared_memory import SharedBuffer, file_name, host_key, new_token


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
    return [dist.isend(local[piece.shard][piece.src].contiguous(), dst=bucket.sender)
            for pu in bucket.units for piece in pu.pieces if piece.holder == rank and bucket.sender != rank]


@dataclass
class StreamResult:
    """What one rank did in one streaming sync."""

    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0
    digests: dict[str, str] = field(default_factory=dict)
    gather_s: float = 0.0  # a sender's wait for its pieces (what double buffering did not hide)
    push_s: float = 0.0  # a sender's time in push() and waiting for the engines to finish reading its buckets
    turn_s: dict[int, float] = field(default_factory=dict)  # sequential: each stage's turn, barrier to barrier


class WeightStreamer:
    """One rank's side of the streaming sync (every rank of the trainer world makes one and calls stream()).

    Args:
        model: the unwrapped megatron GPTModel (one pipeline chunk).
        mapping: the conversion mapping (mpo.models.hf_mapping.mapping_for(cfg, spec="local")).
        bucket_bytes: bucket size (HF bytes).
        device: where pieces are gathered (the training device).
        host_shared_memory: same-host pieces through shared-memory slots (module docstring); None: on when the
            device is the CPU.
    """

    def __init__(self, model: torch.nn.Module, mapping, *, stage: int, bucket_bytes: int,
                 device: torch.device | str = "cpu", host_shared_memory: bool | None = None) -> None:
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
        return file_name(self.token, self.syncs, f"r{sender}", index, pid=self.pid_of_rank[sender])

    def stream(self, push: Callable[[list[tuple[str, torch.Tensor]]], Any] | None, *, sequential: bool,
               digest: Callable[[str, torch.Tensor], str] | None = None, hf_views: bool = False) -> StreamResult:
        """Collective over the trainer world: every bucket to its sender, which converts it to HF names and calls
        push(bucket) (None: gather and convert only, e.g. a sender with no engines). push may return an object
        with wait() (WeightSync.push_bucket(wait=False)): the bucket's slot is reused only after it returned, so the
        sender places the next bucket while the engines read this one. sequential: stages take turns (each stage
        pushing alone, timed in result.turn_s), else every stage pushes at once (the publisher picks:
        Transport.stages_at_once). digest(name, tensor): per-tensor digests to collect (mpo engine
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
            began = time.perf_counter()
            if turn is None or turn == self.stage:
                mine = [b for b in self.buckets if self.stage_of_rank[b.sender] == self.stage]
                if self.is_sender:
                    self._send_buckets(mine, local, push, digest, result, hf_views)
                else:
                    self._hold_buckets(mine, local)
            if turn is not None and len(order) > 1:
                dist.barrier()
                result.turn_s[turn] = time.perf_counter() - began
        self.syncs += 1
        result.seconds = time.perf_counter() - started
        return result

    def _send_buckets(self, buckets: list[Bucket], local, push, digest, result: StreamResult, hf_views: bool) -> None:
        if not buckets:
            return
        # Two slots, allocated once per sync: bucket k is converted and pushed from one while bucket k+1's receives
        # land in the other (double buffering), so the gathers overlap the push and memory stays two buckets.
        in_place = self.in_place(self.rank)
        numel = max(_slot_layout(b, in_place)[2] for b in buckets)
        count = min(2, len(buckets))
        if self.shared:
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
                if push is not None:
                    began = time.perf_counter()
                    ticket = push(named)
                    result.push_s += time.perf_counter() - began
                    if ticket is not None:
                        reading[k % 2] = ticket
                if digest is not None:  # while the engines copy the bucket out (both only read the slot)
                    result.digests.update((name, digest(name, t)) for name, t in named)
                if pending is not None:
                    pending.place_own()  # while the engines copy bucket k out of the other slot
                result.bytes += sum(t.numel() * t.element_size() for _, t in named)
                result.buckets += 1
                del named, tensors
        except BaseException:  # never free a slot an engine may still be reading; the first error is the one raised
            for slot in range(len(slots)):
                with contextlib.suppress(Exception):  # an engine failing the same sync again says nothing new
                    settle(slot)
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
