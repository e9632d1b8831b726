"""The sync plan (see mpo.weight_sync): units, pieces and buckets, from megatron's sharding metadata, never the data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


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

    unit: Any  # mpo.models.hf_mapping.Unit
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
    from mpo.models.full_state import main_shards

    shards = main_shards(model)
    return ([ShardMeta(item.key, tuple(item.global_shape), tuple(item.global_offset), tuple(item.data.shape))
             for item in shards], [item.data.detach() for item in shards])


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def build_plan(mapping, shards_by_rank: Sequence[Sequence[ShardMeta]], stage_of_rank: Sequence[int],
               bucket_bytes: int, dtype_bytes: int) -> tuple[list[PlannedUnit], list[Bucket]]:
    """The plan every rank computes identically from the same gathered metadata: units in mapping order, with their
    pieces and sender, grouped into per-sender buckets of at most bucket_bytes (a larger unit gets its own)."""
    from mpo.models.hf_source import ConversionError

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
