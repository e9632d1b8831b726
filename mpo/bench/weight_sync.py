"""Weight-sync throughput: WeightSync's tensor path (and distributed path) into a locally started mpo engine vs a
plain in-process memcpy (torch `copy_`) of the same bytes, in one run. The tensors carry the engine model's HF names
and shapes (random values), so the engine stages and applies them as a real sync. Each path runs `--rounds` times;
the table shows the median and best bytes/s; the memcpy line is the upper bound for moving those bytes once.

`--sweep`: the trainer's real streaming sync (mpo.weight_sync.gather, as the publisher drives it) from 4 gloo ranks
holding a megatron model at TP2xEP2 into a local mpo engine of the same shape, at two model sizes (presets
sync_bench_1l / sync_bench_12l: ~36M and ~342M parameters, same largest tensor). By default over the sender's
shared-memory slots (`--transport shm`, how a CPU trainer syncs an engine on its host); `--transport distributed
--gloo-gather` is the all-gloo path, the shape of what NCCL does on GPU. Per rank it records the peak RSS increase
during each sync (Linux: VmHWM after resetting it with /proc/self/clear_refs, minus VmRSS before; page cache does
not count) and the push time (first gather to the last bucket acknowledged; the engine's apply at
/end_weight_update apart; the checksum is verified by one more, unmeasured, sync). The last line is
`sync-scaling peak_growth=<x> size_ratio=<y> bytes_per_s_vs_memcpy=<z>`: the larger run's peak per-rank increase
over the smaller run's, the parameter ratio, and the larger run's median push bytes/s over a single-thread memcpy
of 4 MiB tensors.

`--shape`: the sync's shape (issue #50) at PP2 x EP2 (`--layout 1,2,2`) of preset sync_shape_bench (1536 expert
tensors of 16 x 16, the shape of Qwen3-30B-A3B's ~18k at a size two CPU cores sync in seconds) over the distributed
transport into one local mpo engine, every round once with the stages taking turns and once all at once. The last
line is `sync-shape collectives_per_sync_vs_buckets=<x> stage_overlap=<y> fp8_bytes_vs_bf16=<z>`: collectives
issued per bucket, the stages' wall time at once over the sum of their turns alone (median of rounds), and the
bytes of the model's tensors in fp8_block over bf16. The line before it states the CPU seconds the ranks and the
engine spent per sync, in turns and at once, against the host's cores and load: on a host whose cores are shared
the stages compete for CPU, not links, so y there says little about a cluster (y >= 1 on a loaded 2-core host).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _named_tensors(preset: str, seed: int):
    import torch

    from mpo.models.hf_mapping import mapping_for
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


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _rank_streamer(rank: int, world: int, preset: str, layout: tuple[int, int, int], bucket_bytes: int,
                   shared: bool | None = None):
    """One trainer rank's model (`preset` at TP,EP,PP `layout`, seed 7, fp32) and its WeightStreamer, one thread."""
    import torch

    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from mpo.models.builder import PrecisionConfig, build_model, unwrap
    from mpo.models.config import preset as get_preset
    from mpo.models.hf_mapping import mapping_for
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.weight_sync.gather import WeightStreamer

    tp, ep, pp = layout
    cfg = get_preset(preset)
    ctx = initialize_parallel(ParallelConfig(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp),
                              rank=rank, world_size=world, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                              num_attention_heads=cfg.num_attention_heads)
    gpt = unwrap(build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype="fp32"), seed=7))
    return gpt, WeightStreamer(gpt, mapping_for(cfg, spec="local"),
                               stage=parallel_state.get_pipeline_model_parallel_rank(), bucket_bytes=bucket_bytes,
                               device=ctx.device.device, host_shared_memory=shared)


def _sweep_rank(rank: int, world: int, port: int, preset: str, url: str, transport: str, bucket_bytes: int,
                rounds: int, out: str, layout: tuple[int, int, int], shared: bool) -> None:
    """One trainer rank of a sweep run: build the model at the layout, stream it `rounds` times, record peaks."""
    import json
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from mpo.rollout.client import EngineClient
    from mpo.weight_sync.transports import WeightSync, transport_class
    from mpo.weight_sync.verify import combine_digests, tensor_digest, verify_checksum

    gpt, streamer = _rank_streamer(rank, world, preset, layout, bucket_bytes, shared)
    sync = (WeightSync([EngineClient(url, timeout_s=600)], engine="mpo", transport=transport,
                       bucket_bytes=bucket_bytes, timeout_s=600) if streamer.is_sender else None)
    records = []
    # Round 0 warms up (group creation, first-touch of buffers) and is not reported; the last round is not measured
    # (hashing is not the sync's cost): the engine must hold exactly what was streamed.
    for k in range(rounds + 2):
        verify = k == rounds + 1
        push = (lambda named, v=k: sync.push_bucket(named, v, wait=False)) if sync is not None else None
        dist.barrier()
        rss_before = _rss_kib("VmRSS")
        exact = _reset_peak()
        started = time.perf_counter()
        if rank == 0:
            sync.begin_session()
        dist.barrier()
        # distributed: one group spanning the engines (no prepare), so stages take turns
        result = streamer.stream(push, sequential=transport == "distributed",
                                 hf_views=transport_class(transport).in_place,
                                 digest=(lambda name, t: tensor_digest(t)) if verify else None)
        dist.barrier()
        pushed = time.perf_counter()
        if rank == 0:
            sync.end_session()
        dist.barrier()
        done = time.perf_counter()
        peak = (_rss_kib("VmHWM") if exact else _rss_kib("VmRSS")) - rss_before
        if not verify:
            records.append({"push_s": pushed - started, "total_s": done - started, "bytes": result.bytes,
                            "buckets": result.buckets, "peak_kib": peak, "exact_peak": exact,
                            "gather_s": result.gather_s, "engine_push_s": result.push_s})
    parts = [None] * world if rank == 0 else None
    dist.gather_object(result.digests, parts, dst=0)
    if rank == 0:
        verify_checksum(sync.clients, combine_digests(parts))  # raises if the engine got anything else
    if sync is not None:
        sync.close()
    per_rank = [None] * world
    dist.all_gather_object(per_rank, records)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": per_rank, "params": sum(p.numel() for p in gpt.parameters())}))
    dist.barrier()
    dist.destroy_process_group()


def _start_engine(log_stem: Path, extra_args: list[str]):
    """A started local mpo engine for a benchmark (logs at `<log_stem>-<attempt>.log`), tried twice: the port picked
    free may be taken before the engine binds it on a shared host."""
    from mpo.rollout.local_engine import LocalEngineProcess

    for attempt in range(2):
        engine = LocalEngineProcess.mpo_engine(log_path=log_stem.with_name(f"{log_stem.name}-{attempt}.log"),
                                               extra_args=extra_args)
        engine.startup_timeout_s = 900
        try:
            engine.start()
            return engine
        except RuntimeError:
            if attempt:
                raise


def _sweep_run(preset: str, args, tmp: Path) -> dict:
    import json

    import torch.multiprocessing as mp

    from mpo.parallel.ports import free_port

    layout = tuple(int(x) for x in args.layout.split(","))
    out = tmp / f"{preset}.json"
    engine = _start_engine(tmp / f"engine-{preset}", ["--preset", preset, "--no-fp32-lm-head",
                                                      "--max-body-mb", str(4 * args.bucket_mb + 64)])
    try:
        mp.start_processes(_sweep_rank, args=(4, free_port(), preset, engine.url, args.transport,
                                              int(args.bucket_mb * 2**20), args.rounds, str(out), layout,
                                              not args.gloo_gather),
                           nprocs=4, join=True, start_method="spawn")
    finally:
        engine.stop()
    return json.loads(out.read_text())


def sweep(args) -> int:
    import math

    from mpo.models.hf_mapping import mapping_for
    from mpo.models.config import preset as get_preset

    sizes = {p: sum(math.prod(s) for u in mapping_for(get_preset(p), spec="local").units() for s in u.rule.hf_shapes)
             for p in ("sync_bench_1l", "sync_bench_12l")}
    import torch

    torch.set_num_threads(1)
    buffers = [(str(i), torch.randn(1 << 20)) for i in range(128)]  # 512 MiB of 4 MiB tensors
    memcpy = statistics.median(_memcpy_rates(buffers, 5))
    del buffers
    runs = {}
    with tempfile.TemporaryDirectory(prefix="mpo-bench-sweep-") as tmp:
        for preset in sizes:
            runs[preset] = _sweep_run(preset, args, Path(tmp))
    gather = "gloo" if args.gloo_gather else "shared-memory slots"
    print(f"streaming sync, 4 gloo ranks at TP,EP,PP={args.layout}, pieces via {gather}, transport {args.transport}, "
          f"buckets of {args.bucket_mb:g} MiB, {args.rounds} rounds after one warm-up; "
          f"memcpy {memcpy / 2**20:.0f} MiB/s")
    print(f"{'preset':16s} {'params':>10s} {'MiB':>8s} {'buckets':>8s} {'push s':>8s} {'total s':>8s} "
          f"{'push MiB/s':>11s} {'peak +MiB/rank (0..3)':>28s}")
    peaks, rates = {}, {}
    for preset, run in runs.items():
        ranks = run["ranks"]
        rounds = list(zip(*ranks))[1:] or list(zip(*ranks))  # skip the warm-up round
        push = statistics.median(max(r["push_s"] for r in rnd) for rnd in rounds)
        total = statistics.median(max(r["total_s"] for r in rnd) for rnd in rounds)
        nbytes = sum(r["bytes"] for r in rounds[0])
        per_rank = [max(rnd[i]["peak_kib"] for rnd in rounds) / 1024 for i in range(len(ranks))]
        peaks[preset], rates[preset] = max(per_rank), nbytes / push
        buckets = sum(r["buckets"] for r in rounds[0])
        waits = statistics.median(sum(r["gather_s"] for r in rnd) for rnd in rounds)
        engine = statistics.median(sum(r["engine_push_s"] for r in rnd) for rnd in rounds)
        print(f"  {preset}: senders waited {waits:.2f} s for pieces, {engine:.2f} s for engine pushes (calls and acks)")
        print(f"{preset:16s} {sizes[preset] / 1e6:9.1f}M {nbytes / 2**20:8.1f} {buckets:8d} "
              f"{push:8.2f} {total:8.2f} {nbytes / push / 2**20:11.1f} {' '.join(f'{p:6.1f}' for p in per_rank):>28s}")
    small, large = sizes
    print(f"sync-scaling peak_growth={peaks[large] / peaks[small]:.3f} size_ratio={sizes[large] / sizes[small]:.2f} "
          f"bytes_per_s_vs_memcpy={rates[large] / memcpy:.3f}")
    return 0


def _shape_rank(rank: int, world: int, port: int, *args) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    shape_rank(*args)


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system, every thread) of process `pid` so far; this process's for None."""
    import os

    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shape_rank(preset: str, url: str, bucket_bytes: int, rounds: int, out: str, layout: tuple[int, int, int],
               engine_pid: int | None = None) -> None:
    """One trainer rank of `--shape` (torchrun's environment: RANK, WORLD_SIZE, MASTER_*): the streaming sync over
    the distributed transport (gloo, one group per sender and engine), per round once with the stages taking turns
    (each stage alone, StreamResult.turn_s) and once with every stage pushing at once; counts the collectives each
    sender issued, records when each sender pushed, and verifies the engine's checksum after the last concurrent
    sync. Each rank records the CPU seconds it used per sync, rank 0 also the engine's (`engine_pid`, same host).
    Rank 0 writes every rank's records to `out` (JSON)."""
    import json
    import os

    import torch.distributed as dist

    from mpo.rollout.client import EngineClient
    from mpo.weight_sync.transports import WeightSync
    from mpo.weight_sync.verify import combine_digests, tensor_digest, verify_checksum

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _, streamer = _rank_streamer(rank, world, preset, layout, bucket_bytes)
    # rank 0 opens and closes the session; every sender pushes with its own WeightSync (as the publisher does)
    sync = (WeightSync([EngineClient(url, timeout_s=600)], engine="mpo", transport="distributed",
                       bucket_bytes=bucket_bytes, timeout_s=600) if streamer.is_sender or rank == 0 else None)
    if sync is not None and streamer.is_sender:
        sync.via.prepare(sync.via.stages_at_once(len(streamer.senders), len(sync.clients)))
        sync.connect()  # group creation is once per run, not part of a sync

    def one_sync(version: int, sequential: bool, verify: bool) -> dict:
        window: list[float] = []  # wall-clock times of this sender's first push's start and last push's end

        def push(named):
            window[:1] = window[:1] or [time.time()]
            sync.push_bucket(named, version)
            window[1:] = [time.time()]

        before = sync.collectives if sync is not None else 0
        if rank == 0:
            sync.begin_session(pause=False)
        dist.barrier()
        cpu = _cpu_s(None), (_cpu_s(engine_pid) if rank == 0 and engine_pid else 0.0)
        started = time.perf_counter()
        result = streamer.stream(push if streamer.is_sender else None, sequential=sequential,
                                 digest=(lambda name, t: tensor_digest(t)) if verify else None)
        dist.barrier()
        wall = time.perf_counter() - started
        cpu = _cpu_s(None) - cpu[0], (_cpu_s(engine_pid) - cpu[1] if rank == 0 and engine_pid else 0.0)
        if rank == 0:
            sync.end_session()
        if verify:
            parts = [None] * world if rank == 0 else None
            dist.gather_object(result.digests, parts, dst=0)
            if rank == 0:
                verify_checksum(sync.clients, combine_digests(parts))  # raises if the engine got anything else
        return {"wall_s": wall, "turn_s": result.turn_s, "buckets": result.buckets, "bytes": result.bytes,
                "collectives": (sync.collectives if sync is not None else 0) - before, "push_window": window,
                "verified": verify, "cpu_s": cpu[0], "engine_cpu_s": cpu[1]}

    records = []
    for k in range(rounds + 1):  # round 0 warms up (first touch of buffers on both sides)
        alone = one_sync(2 * k, sequential=True, verify=False)
        together = one_sync(2 * k + 1, sequential=False, verify=k == rounds)
        if k:
            records.append({"alone": alone, "together": together})
    if sync is not None:
        sync.close()
    per_rank = [None] * world
    dist.all_gather_object(per_rank, records)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": per_rank, "senders": streamer.senders}))
    dist.barrier()
    dist.destroy_process_group()


def _fp8_ratio(preset: str) -> float:
    """Bytes of the model's HF tensors in fp8_block over bf16, through mpo.weight_sync.fp8.to_engine_format."""
    import torch

    from mpo.weight_sync.fp8 import to_engine_format

    named = [(name, t.to(torch.bfloat16)) for name, t in _named_tensors(preset, seed=0)]
    size = lambda fmt: sum(t.numel() * t.element_size() for _, t in to_engine_format(named, fmt))
    return size("fp8_block") / size("bf16")


def shape(args) -> int:
    import json

    import torch.multiprocessing as mp

    from mpo.parallel.ports import free_port

    layout = tuple(int(x) for x in args.layout.split(","))
    with tempfile.TemporaryDirectory(prefix="mpo-bench-shape-") as tmp:
        out = Path(tmp) / "shape.json"
        engine = _start_engine(Path(tmp) / "engine", ["--preset", args.preset, "--no-fp32-lm-head"])
        try:
            mp.start_processes(_shape_rank, args=(4, free_port(), args.preset, engine.url,
                                                  int(args.bucket_mb * 2**20), args.rounds, str(out), layout,
                                                  engine.process.pid),
                               nprocs=4, join=True, start_method="spawn")
        finally:
            engine.stop()
        run = json.loads(out.read_text())
    rounds = list(zip(*run["ranks"]))  # per round: every rank's record
    buckets = sum(r["together"]["buckets"] for r in rounds[0])
    collectives = sum(r["together"]["collectives"] for r in rounds[0])
    together = statistics.median(max(r["together"]["wall_s"] for r in rnd) for rnd in rounds)
    alone = statistics.median(sum(rnd[0]["alone"]["turn_s"].values()) for rnd in rounds)
    turns = {stage: statistics.median(rnd[0]["alone"]["turn_s"][stage] for rnd in rounds)
             for stage in rounds[0][0]["alone"]["turn_s"]}
    nbytes = sum(r["together"]["bytes"] for r in rounds[0])
    tensors = len(_named_tensors(args.preset, seed=0))
    print(f"sync shape: preset {args.preset} ({tensors} HF tensors, {nbytes / 2**20:.1f} MiB fp32), 4 gloo ranks at "
          f"TP,EP,PP={args.layout} ({len(run['senders'])} senders), transport distributed into one mpo engine, "
          f"buckets of {args.bucket_mb:g} MiB, {args.rounds} rounds after one warm-up")
    print(f"  per sync: {buckets} buckets, {collectives} collectives ({tensors} before buckets were flattened)")
    print(f"  stages alone: {', '.join(f'stage {s} {t:.2f} s' for s, t in sorted(turns.items()))} "
          f"(sum {alone:.2f} s); all stages at once: {together:.2f} s")
    # Where the stages' time goes: CPU seconds of the 4 ranks and the engine per sync over its wall time is the
    # number of cores the sync kept busy. Stages can overlap only into cores the host has free.
    import os

    def busy(mode: str) -> tuple[float, float]:
        cpu = statistics.median(sum(r[mode]["cpu_s"] + r[mode]["engine_cpu_s"] for r in rnd) for rnd in rounds)
        wall = together if mode == "together" else alone
        return cpu, cpu / max(wall, 1e-9)

    (cpu_alone, cores_alone), (cpu_together, cores_together) = busy("alone"), busy("together")
    engine_cpu = {mode: statistics.median(rnd[0][mode]["engine_cpu_s"] for rnd in rounds)
                  for mode in ("alone", "together")}
    cores = len(os.sched_getaffinity(0))  # the cores this process may run on (cpu_count counts the machine's)
    print(f"  CPU (4 ranks + engine): stages in turns {cpu_alone:.2f} cpu-s ({cores_alone:.2f} cores busy), at once "
          f"{cpu_together:.2f} cpu-s ({cores_together:.2f} cores busy); of which the engine (one process, its Python "
          f"serialised by the GIL) {engine_cpu['alone']:.2f} / {engine_cpu['together']:.2f} cpu-s; this host: "
          f"{cores} cores, load average {os.getloadavg()[0]:.1f}")
    # The least stage_overlap this host allows: at once cannot beat the longest stage alone, nor the CPU it needs
    # spread over every core here; a y near this bound measures the host's cores, not the sync's shape.
    bound = max(max(turns.values()), cpu_together / cores) / alone
    print(f"  this host's bound: stage_overlap >= {bound:.2f} (the longest stage alone, or the at-once CPU over "
          f"{cores} cores; stage_overlap {together / alone:.2f} keeps {cores_together / cores:.0%} of them busy)")
    print(f"sync-shape collectives_per_sync_vs_buckets={collectives / buckets:.3f} "
          f"stage_overlap={together / alone:.3f} fp8_bytes_vs_bf16={_fp8_ratio(args.preset):.3f}")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench weight_sync", description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="the trainer's streaming sync at two model sizes")
    parser.add_argument("--shape", action="store_true",
                        help="the sync's shape at PP2 x EP2 with many small expert tensors: collectives per bucket, "
                             "stage overlap, fp8 bytes")
    parser.add_argument("--transport", default="shm", help="--sweep: shm, tensor or distributed")
    parser.add_argument("--gloo-gather", action="store_true",
                        help="--sweep: pieces reach their sender over gloo, not through shared memory")
    parser.add_argument("--layout", default="2,2,1", help="--sweep: TP,EP,PP of the 4 ranks")
    parser.add_argument("--preset", default="tiny", help="engine model preset (names and shapes of the tensors)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (--sweep: 3)")
    parser.add_argument("--bucket-mb", type=float, default=None, help="default 4 (--sweep: 16)")
    parser.add_argument("--transports", default="tensor,distributed")
    args = parser.parse_args(argv)
    if args.shape:
        args.preset = args.preset if args.preset != "tiny" else "sync_shape_bench"
        args.layout = args.layout if args.layout != "2,2,1" else "1,2,2"
        args.rounds, args.bucket_mb = args.rounds or 2, args.bucket_mb or 0.0625
        return shape(args)
    if args.sweep:
        # 16 MiB, not the trainer's 64: the smaller model (138 MiB) must span many buckets for memory to be bounded
        # by them rather than by the model
        args.rounds, args.bucket_mb = args.rounds or 3, args.bucket_mb or 16.0
        return sweep(args)
    args.rounds, args.bucket_mb = args.rounds or 5, args.bucket_mb or 4.0

    import torch

    from mpo.bench._util import push_whole
    from mpo.rollout.local_engine import LocalEngineProcess
    from mpo.weight_sync.transports import WeightSync
    from mpo.weight_sync.verify import verify_checksum, weights_checksum

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
                    rates = [push_whole(sync, named, version=i).bytes_per_s for i in range(args.rounds)]
                    verify_checksum(sync.clients, weights_checksum(named))  # what was timed arrived intact
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
