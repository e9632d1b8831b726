"""Weight-sync throughput: WeightSync's tensor path (and distributed path) into a locally started mpo engine vs a
plain in-process memcpy (torch `copy_`) of the same bytes, in one run.

The tensors carry the engine model's HF names and shapes (random values), so the engine stages and applies them as a
real sync. Each path runs `--rounds` times; the table shows the median and best bytes/s. The memcpy line is the upper
bound for moving those bytes once in memory; the ratio shows what serialisation, HTTP (or the gloo collective), and
the engine's staging/apply cost on top.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _named_tensors(preset: str, seed: int):
    import torch

    from checkpoints_tools.mapping import mapping_for
    from mpo.models.config import preset as get_preset

    generator = torch.Generator().manual_seed(seed)
    return [(name, 0.02 * torch.randn(tuple(shape), generator=generator))
            for unit in mapping_for(get_preset(preset), spec="local").units()
            for name, shape in zip(unit.hf_names, unit.rule.hf_shapes)]


def _memcpy_rates(named, rounds: int) -> list[float]:
    import torch

    total = sum(t.numel() * t.element_size() for _, t in named)
    targets = [torch.empty_like(t) for _, t in named]
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        for (_, src), dst in zip(named, targets):
            dst.copy_(src)
        rates.append(total / (time.perf_counter() - start))
    return rates


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench weight_sync", description=__doc__)
    parser.add_argument("--preset", default="tiny", help="engine model preset (names and shapes of the tensors)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--transports", default="tensor,distributed")
    args = parser.parse_args(argv)

    import torch

    from mpo.rollout.local_engine import LocalEngineProcess
    from mpo.rollout.weight_sync import WeightSync

    torch.set_num_threads(1)
    named = _named_tensors(args.preset, seed=0)
    total = sum(t.numel() * t.element_size() for _, t in named)
    bucket_bytes = int(args.bucket_mb * 2**20)
    rows: dict[str, list[float]] = {"memcpy (torch copy_)": _memcpy_rates(named, args.rounds)}
    with tempfile.TemporaryDirectory(prefix="mpo-bench-sync-") as tmp:
        with LocalEngineProcess.mpo_engine(log_path=Path(tmp) / "engine.log",
                                           extra_args=["--preset", args.preset]) as engine:
            for transport in args.transports.split(","):
                sync = WeightSync([engine.client], engine="mpo", transport=transport, bucket_bytes=bucket_bytes)
                try:
                    rates = [sync.push(named, version=f"bench{i}").bytes_per_s for i in range(args.rounds)]
                    sync.verify(named)  # what was timed arrived intact
                finally:
                    sync.close()
                rows[f"WeightSync {transport} -> mpo engine"] = rates
    print(f"weight sync of {len(named)} tensors, {total / 2**20:.2f} MiB fp32 (preset {args.preset}), buckets of "
          f"{args.bucket_mb:g} MiB, {args.rounds} rounds each, one run")
    memcpy = statistics.median(rows["memcpy (torch copy_)"])
    print(f"{'path':34s} {'median MiB/s':>14s} {'best MiB/s':>12s} {'vs memcpy':>10s}")
    for name, rates in rows.items():
        median = statistics.median(rates)
        print(f"{name:34s} {median / 2**20:14.1f} {max(rates) / 2**20:12.1f} {median / memcpy:10.4f}")
    return 0
