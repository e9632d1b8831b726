"""Sequence packing by token budget and balanced data-parallel shares (schedule.max_tokens_per_microbatch).

Padding every row of a pass to its longest sample wastes most of the FLOPs of long-tailed (reasoning) batches. With a
budget set, each mini-batch is split over the data-parallel ranks by Karmarkar-Karp over the sample lengths (the
largest differencing method, as verl balances its DP shares), so every rank gets about the same number of tokens;
each rank's share is packed first-fit-decreasing into micro-batches of at most `max_tokens` tokens and `max_rows`
samples (schedule.micro_batch_size), each one row ``[1, S]`` with its sequences end to end (mpo.models.packed).
The losses' global denominators are all-reduced over DP, so which rank holds a sample does not change them.

Layout constraints (what megatron needs):
* TP with sequence parallelism splits the row over TP ranks: S is a multiple of TP (padded at the row's end).
* PP: megatron's p2p buffers are sized once per pass, so every micro-batch of a pass (every mini-batch's, on every
  rank of the pipeline) has one shape: the fullest packed row of the pass (at most the budget unless a single sample
  is longer), not the longest sample padded to micro_batch_size rows.
* EP (and VPP's groups of PP): every DP rank runs the same number of micro-batches; ranks with fewer bins run
  loss-free two-token micro-batches, as padded rows do (mpo.trainer.rows).
All ranks compute every rank's share from the same sample lengths (each rank receives its own samples whole and
the others' lengths: mpo.trainer.distribute), so they agree without communication.
"""

from __future__ import annotations

import heapq
import itertools
import logging

import torch

from mpo.models.forward import MicroBatch
from mpo.models.packed import PackedLayout
from mpo.trainer.rows import Sample, _pad_sample, sample_extras

log = logging.getLogger(__name__)


def karmarkar_karp(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of `lengths` in `parts` sets with sums as equal as the largest differencing method makes them
    (each set sorted ascending; sets ordered by index of their first member, empty sets last)."""
    if parts < 1:
        raise ValueError(f"parts={parts}; must be >= 1")
    counter = itertools.count()
    heap = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        sets = [[i]] + [[] for _ in range(parts - 1)]
        sums = [lengths[i]] + [0] * (parts - 1)
        heapq.heappush(heap, (-(sums[0] - sums[-1]), next(counter), sets, sums))
    while len(heap) > 1:
        _, _, sets_a, sums_a = heapq.heappop(heap)
        _, _, sets_b, sums_b = heapq.heappop(heap)
        # a's largest set with b's smallest, and so on: the difference of the two partitions
        merged = sorted(((sums_a[k] + sums_b[parts - 1 - k], sets_a[k] + sets_b[parts - 1 - k]) for k in range(parts)),
                        key=lambda x: -x[0])
        sums, sets = [m[0] for m in merged], [m[1] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), next(counter), sets, sums))
    sets = heap[0][2] if heap else [[] for _ in range(parts)]
    return sorted((sorted(s) for s in sets), key=lambda s: (not s, s[0] if s else 0))


def first_fit_bins(lengths: dict[int, int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Indices (keys of `lengths`) in bins of at most `max_tokens` tokens and `max_rows` members, first fit over
    decreasing lengths; a sample longer than the budget gets a bin of its own."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        for b, members in enumerate(bins):
            if used[b] + lengths[i] <= max_tokens and len(members) < max_rows:
                members.append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return [sorted(b) for b in bins]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def packed_microbatch(rows: list[Sample], n_real: int, row_len: int, *, thd: bool) -> MicroBatch:
    """One packed row of `rows` (real samples first) right-padded to `row_len`; extras in the sample layout."""
    layout = PackedLayout.build([len(s.ids) for s in rows], row_len, thd=thd)
    ids = torch.zeros(1, row_len, dtype=torch.long)
    ids[0, : sum(len(s.ids) for s in rows)] = torch.cat([torch.as_tensor(s.ids).long() for s in rows])
    return MicroBatch(ids, layout.position_ids(), sample_extras(rows, n_real, max(len(s.ids) for s in rows)), layout)


def pack_pass(minis: list[list[Sample]], *, dp_rank: int, dp_size: int, max_tokens: int, max_rows: int,
              tp: int = 1, uniform: bool = False, multiple: int = 1, thd: bool = False,
              device: torch.device | str = "cpu") -> list[list[MicroBatch]]:
    """This DP rank's packed micro-batches of every mini-batch of one pass.

    Args:
        minis: the pass's mini-batches (all ranks hold the same lists).
        max_tokens / max_rows: the budget per micro-batch (schedule.max_tokens_per_microbatch / micro_batch_size).
        tp: row lengths are multiples of it (sequence parallelism; 2 x CP x TP under context parallelism).
        uniform: one row length for the whole pass (pipeline parallelism).
        multiple: micro-batches per mini-batch are a multiple of it (virtual pipeline stages).
        thd: the attention switch of mpo.models.packed (Transformer Engine's THD format).
    """
    plans = []  # per mini-batch: every rank's bins (lists of indices into the mini-batch)
    for mini in minis:
        lengths = [len(s.ids) for s in mini]
        shares = karmarkar_karp(lengths, dp_size)
        plans.append([first_fit_bins({i: lengths[i] for i in share}, max_tokens, max_rows) for share in shares])
    longest = max((len(s.ids) for mini in minis for s in mini), default=0)
    if longest > max_tokens:
        log.warning("a sample of %d tokens exceeds schedule.max_tokens_per_microbatch=%d: it runs alone%s", longest,
                    max_tokens, " and sets the pass's one row length (PP)" if uniform else "")
    fullest = max((sum(len(minis[m][i].ids) for i in b) for m, plan in enumerate(plans) for bins in plan
                   for b in bins), default=2)
    out = []
    for mini, plan in zip(minis, plans):
        count = _round_up(max(1, max(len(bins) for bins in plan)), multiple)
        mbs = []
        for m in range(count):
            real = [mini[i] for i in plan[dp_rank][m]] if m < len(plan[dp_rank]) else []
            rows = real or [_pad_sample(2)]
            used = sum(len(s.ids) for s in rows)
            row_len = _round_up(fullest if uniform else used, tp)
            mbs.append(packed_microbatch(rows, len(real), row_len, thd=thd).to(device))
        out.append(mbs)
    return out
