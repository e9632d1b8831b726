"""Weight sync over CUDA IPC on one GPU: the ~1.5B-parameter `gpu_1b` model's HF tensors, in buckets, through
`mpo.weight_sync.wire.cuda_ipc_payload` (what `sync.transport=cuda_ipc` sends a colocated SGLang engine) to a receiver
process on the same GPU, which maps each bucket from its IPC handle and copies it into its own preallocated weights
(as SGLang's flattened-bucket loader copies into its parameters), then acknowledges, so the sender may reuse the memory.

The reference, measured in the same run on the same bytes: one device-to-device copy of every tensor in the sender.
The receiver's float64 sum of every tensor it holds after the last round is checked against the sender's.
Last line: `cuda-ipc gbytes=<GB per sync> ipc_gb_per_s=<x> d2d_gb_per_s=<y> ratio=<x/y>` (medians over rounds).
Needs CUDA (one line and exit 1 without it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def random_hf_weights(model_cfg, seed: int, device: str = "cuda") -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of the model as the trainer sends them: bf16 body, fp32 LM head; norms near 1, matrices
    small (so a model loaded from them computes finite log-probs)."""
    from mpo.models.hf_mapping import mapping_for

    generator = torch.Generator(device=device).manual_seed(seed)
    named = []
    for unit in mapping_for(model_cfg, spec="local").units():
        for name, shape in zip(unit.hf_names, unit.rule.hf_shapes):
            dtype = torch.float32 if name == "lm_head.weight" else torch.bfloat16
            scale, offset = (0.1, 1.0) if len(shape) == 1 else (0.02, 0.0)
            named.append((name, (torch.randn(shape, generator=generator, device=device) * scale + offset).to(dtype)))
    return named


def buckets_of(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive single-dtype runs of at most `bucket_bytes` (a tensor larger than that is a bucket of its own)."""
    from mpo.weight_sync.wire import split_by_dtype
    from mpo.bench._util import make_buckets

    return [bucket for run in split_by_dtype(named) for bucket in make_buckets(run, bucket_bytes)]


def _receive(conn, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """The receiver process: map each payload's CUDA tensor, copy it into its own weights, acknowledge."""
    import base64
    import pickle

    torch.cuda.set_device(0)
    weights = {name: torch.empty(shape, dtype=dtype, device="cuda") for name, (shape, dtype) in shapes.items()}
    conn.send("ready")
    while True:
        message = conn.recv()
        if message == "sums":
            conn.send({name: t.double().sum().item() for name, t in weights.items()})
            continue
        if message == "stop":
            return
        bucket = pickle.loads(base64.b64decode(message))  # torch's reductions rebuild the CUDA tensor from its handle
        flat = bucket["flattened_tensor"]
        for meta in bucket["metadata"]:
            weights[meta.name].view(-1).copy_(flat[meta.start_idx:meta.end_idx])
        torch.cuda.synchronize()
        del bucket, flat
        conn.send("ok")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench cuda_ipc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpu_1b", help="model preset (mpo.models.config.PRESETS)")
    parser.add_argument("--bucket-mb", type=int, default=512, help="bucket size in MiB")
    parser.add_argument("--rounds", type=int, default=3, help="timed syncs (the median is reported)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mpo.bench cuda_ipc needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1

    import torch.multiprocessing as mp

    from mpo.models.config import preset
    from mpo.weight_sync.wire import cuda_ipc_payload

    cfg = preset(args.preset)
    named = random_hf_weights(cfg, seed=1)
    total = sum(t.numel() * t.element_size() for _, t in named)
    buckets = buckets_of(named, args.bucket_mb << 20)
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    receiver = context.Process(target=_receive, args=(theirs, {n: (tuple(t.shape), t.dtype) for n, t in named}),
                               daemon=True)
    receiver.start()
    try:
        if not ours.poll(300) or ours.recv() != "ready":
            print("mpo.bench cuda_ipc: the receiver process did not start in 300 s", file=sys.stderr)
            return 1

        def sync_once() -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for bucket in buckets:
                ours.send(cuda_ipc_payload(bucket))
                if ours.recv() != "ok":  # the receiver copied out of our memory: the bucket may be reused
                    raise RuntimeError("receiver failed")
            return time.perf_counter() - start

        def copy_once(targets: list[torch.Tensor]) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for target, (_, tensor) in zip(targets, named):
                target.copy_(tensor)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        sync_once()  # untimed: CUDA context, IPC handle opening, allocator warm-up on both sides
        ipc = [sync_once() for _ in range(args.rounds)]
        targets = [torch.empty_like(t) for _, t in named]
        copy_once(targets)
        d2d = [copy_once(targets) for _ in range(args.rounds)]
        ours.send("sums")
        theirs_sums = ours.recv()
        ours.send("stop")
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    wrong = [n for n, t in named if abs(theirs_sums[n] - t.double().sum().item()) > 1e-6 * max(1.0, t.numel())]
    if wrong:
        print(f"mpo.bench cuda_ipc: the receiver's weights differ from the sender's for {len(wrong)} tensors, "
              f"e.g. {wrong[0]}", file=sys.stderr)
        return 1
    ipc_s, d2d_s = statistics.median(ipc), statistics.median(d2d)
    gb = total / 1e9
    print(f"{args.preset}: {len(named)} tensors, {gb:.2f} GB in {len(buckets)} buckets of <= {args.bucket_mb} MiB on "
          f"{torch.cuda.get_device_name()}; receiver's weights verified (float64 sums)")
    print(f"cuda ipc sync: {' '.join(f'{s:.3f}' for s in ipc)} s; device-to-device copy: "
          f"{' '.join(f'{s:.3f}' for s in d2d)} s")
    print(f"cuda-ipc gbytes={gb:.3f} ipc_gb_per_s={gb / ipc_s:.1f} d2d_gb_per_s={gb / d2d_s:.1f} "
          f"ratio={d2d_s / ipc_s:.3f}")
    return 0
