"""Shared helpers of the benchmarks: a one-rank megatron world, a whole model pushed to engines in one session."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace


def init_single_rank():
    """Initialise a one-rank world (gloo on CPU) for benchmarks."""
    from mpo.parallel import ParallelConfig, initialize_parallel

    return initialize_parallel(ParallelConfig(), rank=0, world_size=1)


def make_buckets(named: list, bucket_bytes: int) -> list[list]:
    """Consecutive groups of HF-named tensors of at most bucket_bytes each (a larger tensor is a bucket of its own)."""
    buckets: list[list] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def push_whole(sync, named: list, version) -> SimpleNamespace:
    """Every tensor of `named` (a whole model's HF-named tensors) to every engine of WeightSync `sync`, in buckets of
    its bucket_bytes inside one weight-update session tagged `version`: the benches' and tests' one-process push (the
    trainer streams its shards instead: mpo.weight_sync.publisher). Returns its seconds, bytes, buckets, bytes_per_s."""
    started = time.perf_counter()
    buckets = make_buckets(named, sync.bucket_bytes)
    sync.begin_session()
    try:
        for bucket in buckets:
            sync.push_bucket(bucket, version)
    finally:
        sync.end_session()
    seconds, nbytes = time.perf_counter() - started, sum(t.numel() * t.element_size() for _, t in named)
    return SimpleNamespace(seconds=seconds, bytes=nbytes, buckets=len(buckets), bytes_per_s=nbytes / max(seconds, 1e-9))


def run_demo(out: Path, steps: int, overrides: list[str], log: Path, who: str) -> tuple[list[dict], float]:
    """`mpo demo --steps N --out OUT` with progress, TensorBoard, checkpoints and evaluation off, its output in `log`:
    (its metrics rows of RL steps, its wall seconds). A failed run exits with one line naming `who` and the log."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "mpo.cli", "demo", "--steps", str(steps), "--out", str(out),
               "logging.progress=false", "logging.tensorboard=false", "logging.checkpoint_every=0", "eval.every=0",
               *overrides]
    began = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - began
    if code != 0:
        raise SystemExit(f"{who}: the demo failed (exit {code}); see {log}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward_mean" in r], wall  # RL steps (a final evaluation row, with eval on, is not one)


def in_fresh_processes(target, names: tuple[str, ...], *args) -> dict:
    """target(name, *args, queue) in a fresh spawned process per name, one after another (peak-memory measurements
    need a process each); returns {name: what target put on the queue} (plain data: the child exits)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = {}
    for name in names:
        queue = ctx.Queue()
        proc = ctx.Process(target=target, args=(name, *args, queue))
        proc.start()
        results[name] = queue.get()
        proc.join()
    return results
