"""Sequence packing vs padded rows on one long-tailed RL batch: the old-logprob pass plus one update, at world size 2
(`--world-size 1` on a machine with one GPU: NCCL needs a GPU per rank).

One batch of `--samples` responses whose lengths (prompt + response) are lognormal with median `--median` tokens,
capped at `--max-len` (the longest sample is exactly the cap: the tail every reasoning batch has). Each of two ranks
(gloo, DP2) runs the real Trainer's passes on its share: padded (schedule.micro_batch_size rows per micro-batch,
each padded to its longest row, round-robin DP shares) and packed (schedule.max_tokens_per_microbatch, Karmarkar-Karp
DP shares), interleaved `--repeats` times so machine noise hits both alike; a pass's time is the slower rank's,
the median over repeats is reported. The old log-probs of every response are compared between the two (before any
update). Last line:

    packing tokens_ratio=<padded tokens / real tokens> time_ratio=<packed time / padded time> max_logprob_diff=<x>
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def lengths(samples: int, median: int, max_len: int, sigma: float, seed: int) -> list[int]:
    """Lognormal lengths (median `median`), clipped to [8, max_len]; the longest is set to max_len."""
    import random

    rng = random.Random(seed)
    out = [min(max_len, max(8, round(math.exp(rng.gauss(math.log(median), sigma))))) for _ in range(samples)]
    out[max(range(samples), key=out.__getitem__)] = max_len
    return out


def _batch(args) -> list:
    import random

    from mpo.trainer.rows import Sample

    rng = random.Random(args.seed)
    samples = []
    for i, n in enumerate(lengths(args.samples, args.median, args.max_len, args.sigma, args.seed)):
        prompt = min(16, n - 1)
        ids = [rng.randrange(4, 256) for _ in range(n)]
        samples.append(Sample(ids=ids, prompt_len=prompt, group=i // 8, reward=float(i % 2),
                              advantage=1.0 if i % 2 else -1.0,
                              rollout_logprobs=[-3.0] * (n - prompt)))
    return samples


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.parallel.collectives import all_reduce_
    from mpo.trainer.trainer import Trainer

    config = load_config(RECIPES / "demo_cpu.yaml", [
        f"world_size={world}", "parallel.expert_parallel=1", f"logging.out_dir={out}/run",
        f"schedule.micro_batch_size={args.micro_batch_size}", f"data.prompts_per_step={-(-args.samples // 8)}",
        "rollout.samples_per_prompt=8", "algorithm.filter_zero_variance=false"])
    trainer = Trainer(config)
    samples = _batch(args)
    variants = {"padded": config,
                "packed": replace(config, schedule=replace(config.schedule,
                                                           max_tokens_per_microbatch=args.max_tokens))}

    def microbatches(name: str):
        return trainer.pass_microbatches([samples], variants[name].schedule)[0]

    # old log-probs of every response, both variants, same weights
    logprobs: dict[str, dict[int, list[float]]] = {}
    shape_tokens: dict[str, int] = {}
    for name in variants:
        mbs = microbatches(name)
        trainer.policy.old_forward(mbs)
        shape_tokens[name] = sum(mb.input_ids.numel() for mb in mbs)
        index = {id(s): i for i, s in enumerate(samples)}
        logprobs[name] = {index[id(s)]: mb.extras["logp_old"][j, s.prompt_len:len(s.ids)].tolist()
                          for mb in mbs for j, s in enumerate(mb.extras["samples"][: mb.extras["n_real"]])}
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name in variants:
            dist.barrier()
            start = time.perf_counter()
            mbs = microbatches(name)
            records, _ = trainer.policy.old_forward(mbs)
            trainer.policy.update(mbs, records, config.data.prompts_per_step, None)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            all_reduce_(elapsed, op=dist.ReduceOp.MAX)  # on the backend's device (NCCL reduces device tensors only)
            if repeat:
                timings[name].append(float(elapsed))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (logprobs, shape_tokens))
    if rank == 0:
        merged = {name: {} for name in variants}
        tokens = {name: 0 for name in variants}
        for lp, shapes in gathered:
            for name in variants:
                merged[name].update(lp[name])
                tokens[name] += shapes[name]
        diff = max(max((abs(a - b) for a, b in zip(merged["packed"][i], merged["padded"][i])), default=0.0)
                   for i in merged["padded"])
        assert merged["packed"].keys() == merged["padded"].keys() == set(range(len(samples)))
        Path(out, "result.json").write_text(json.dumps({
            "timings": timings, "tokens": tokens, "real": sum(len(s.ids) for s in samples), "diff": diff,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo, 1 thread a rank)"}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench packing", description=__doc__)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--median", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of the lengths")
    parser.add_argument("--micro-batch-size", type=int, default=16, help="padded rows per micro-batch (the row cap)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="schedule.max_tokens_per_microbatch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", type=float, default=None,
                        help="exit 1 when max_logprob_diff is above this (the GPU tier's packing step)")
    parser.add_argument("--world-size", type=int, default=2, choices=(1, 2),
                        help="data-parallel ranks (each gets a GPU when CUDA is there, else a gloo CPU process)")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    from mpo.parallel.ports import free_port

    lens = lengths(args.samples, args.median, args.max_len, args.sigma, args.seed)
    with tempfile.TemporaryDirectory(prefix="mpo-bench-packing-") as out:
        mp.start_processes(_rank, args=(args.world_size, free_port(), args, out), nprocs=args.world_size, join=True,
                           start_method="spawn")
        result = json.loads(Path(out, "result.json").read_text())
    med = {name: statistics.median(t) for name, t in result["timings"].items()}
    print(f"{args.samples} samples, lengths lognormal: median {statistics.median(lens):.0f}, max {max(lens)}, "
          f"{result['real']} tokens; DP{args.world_size} on {result['device']}, tiny MoE fp32")
    for name in ("padded", "packed"):
        print(f"  {name:7s} {result['tokens'][name]:7d} tokens in micro-batches   old-logprob pass + update "
              f"{med[name] * 1e3:8.0f} ms (median of {args.repeats})")
    print(f"packing tokens_ratio={result['tokens']['padded'] / result['real']:.2f} "
          f"time_ratio={med['packed'] / med['padded']:.3f} max_logprob_diff={result['diff']:.2e}")
    return 1 if args.check is not None and not result["diff"] <= args.check else 0
