"""Cost of routing capture relative to a plain forward (``python -m mpo.bench routing``).

Two identical models (same seed), one with :class:`~mpo.routing.capture.RoutingHooks`. Repetitions are interleaved
(plain, capture, capture+replay, plain, ...) so drift in machine load hits all variants alike; medians are reported.
Single process, CPU (or the local GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench routing", description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)

    from mpo.models.builder import build_model
    from mpo.models.config import preset
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.routing.capture import attach_routing_hooks

    cfg = preset(args.preset)
    parallel = ParallelConfig()
    ctx = initialize_parallel(parallel, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                              num_attention_heads=cfg.num_attention_heads)
    plain = build_model(cfg, parallel, ctx.device)
    hooked = build_model(cfg, parallel, ctx.device)
    hooks = attach_routing_hooks(hooked)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    mbs = [MicroBatch(ids.to(ctx.device.device) if ctx.device.is_gpu else ids)]

    def sync() -> None:
        if ctx.device.is_gpu:
            torch.cuda.synchronize()

    def fwd(model) -> None:
        run_microbatches(model, mbs, vocab_size=cfg.vocab_size)

    with hooks.session() as recorded:
        fwd(hooked)
    records = recorded.records

    def capture() -> None:
        with hooks.session():
            fwd(hooked)

    def capture_replay() -> None:
        with hooks.session(replay=records):
            fwd(hooked)

    variants = {"plain": lambda: fwd(plain), "capture": capture, "capture+replay": capture_replay}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.warmup + args.reps):
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"routing capture benchmark: preset={args.preset} tokens={args.batch}x{args.seq} "
          f"layers={cfg.num_layers} experts={cfg.num_experts} top{cfg.router_topk} device={ctx.device.device} "
          f"reps={args.reps} (interleaved, medians)")
    for name, value in med.items():
        print(f"  {name:15s} {value * 1e3:8.3f} ms   ratio to plain {value / med['plain']:.4f}")
    print(f"capture_overhead_ratio={med['capture'] / med['plain']:.4f}")
    return 0
