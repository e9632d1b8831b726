"""Rank body of test_gpu_weight_sync: push a >= 1B-parameter model into a real SGLang server over NCCL (WeightSync's
distributed transport; the server on another GPU) or over CUDA IPC (WeightSync's cuda_ipc transport: the server on
the same GPU maps each bucket from its IPC handle, `mpo.weight_sync.wire.cuda_ipc_payload`, no host round trip),
check the weights arrived, and time the pushes.
"""

from __future__ import annotations

import statistics

import torch


def make_sync(client, transport: str, bucket_mb: int):
    """mpo's own WeightSync for the transport under test: "cuda_ipc" (same GPU) or "nccl" (its distributed path)."""
    from mpo.weight_sync.transports import WeightSync

    return WeightSync([client], engine="sglang", transport="distributed" if transport == "nccl" else transport,
                      bucket_bytes=bucket_mb << 20, timeout_s=600.0)


def run(out_file: str, url: str, preset_name: str, probe: list[int], transport: str, bucket_mb: int,
        rounds: int) -> None:
    from mpo.bench._util import push_whole
    from mpo.bench.cuda_ipc import random_hf_weights
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.rollout.client import EngineClient
    from mpo.weight_sync.verify import run_probes

    ctx = initialize_parallel(ParallelConfig())
    assert ctx.device.backend == "nccl"
    cfg = preset(preset_name)
    client = EngineClient(url, timeout_s=600.0)
    weights = {"a": random_hf_weights(cfg, seed=1), "b": random_hf_weights(cfg, seed=2)}
    sync = make_sync(client, transport, bucket_mb)
    results: dict = {"parameters": sum(t.numel() for _, t in weights["a"]),
                     "bytes": sum(t.numel() * t.element_size() for _, t in weights["a"]), "probe": {}}
    # a, b, then a again: the probe must move with the weights and come back exactly (nothing else is kept).
    for step, which in enumerate("aba"):
        push_whole(sync, weights[which], version=step)
        results["probe"][f"{step}{which}"] = run_probes(client, [probe])[0].logprobs
    results["seconds"] = [push_whole(sync, weights["a"], version=100 + i).seconds for i in range(rounds)]
    results["median_s"] = statistics.median(results["seconds"])
    sync.close()
    torch.save(results, out_file)
    torch.distributed.destroy_process_group()
