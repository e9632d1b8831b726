"""Rank body of test_gpu_weight_sync: push a >= 1B-parameter model into a real SGLang server over NCCL (WeightSync's
distributed transport; the server on another GPU) or over CUDA IPC (the server on the same GPU), check the weights
arrived, and time the pushes.

CUDA IPC: SGLang's /update_weights_from_tensor with `load_format="flattened_bucket"` unpickles the bucket with
torch's tensor reductions, so a CUDA tensor travels as an IPC handle: the server maps the trainer's GPU memory and
copies from it, no host round trip. mpo has no transport for this yet: `mpo.rollout.sglang_wire.flatten_bucket`
always moves the bucket to host memory (`.cpu()`). `CudaIpcWeightSync` below is WeightSync's tensor transport with
the flattened tensor kept on the GPU (what a `rollout.sync="cuda_ipc"` would be); everything else (buckets, the
pause/begin/end/continue session, the payload's pickling) is mpo's.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import torch


def cuda_flattened_bucket(run: list[tuple[str, torch.Tensor]]) -> dict:
    """sglang_wire.flatten_bucket's payload, with the flat tensor left on the GPU."""
    metadata, pos = [], 0
    for name, t in run:
        metadata.append(SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=pos,
                                        end_idx=pos + t.numel(), numel=t.numel()))
        pos += t.numel()
    return {"flattened_tensor": torch.cat([t.detach().reshape(-1) for _, t in run]), "metadata": metadata}


def _cuda_ipc_sync_class():
    from mpo.rollout.sglang_wire import serialize_for_sglang, split_by_dtype
    from mpo.rollout.weight_sync import SGLANG_FORMAT, WeightSync

    class CudaIpcWeightSync(WeightSync):
        def _push_tensor(self, bucket, version):
            for run in split_by_dtype(bucket):
                payload = serialize_for_sglang(cuda_flattened_bucket(run))
                for client, tp in zip(self.clients, self.tp_sizes):
                    client.update_weights_from_tensor([payload] * tp, load_format=SGLANG_FORMAT,
                                                      weight_version=version)
            torch.cuda.synchronize()  # the engine copied out of our memory before the bucket is freed

    return CudaIpcWeightSync


def _random_weights(model_cfg, seed: int) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of the model on the GPU, as the trainer sends them: bf16 body, fp32 LM head."""
    from checkpoints_tools.mapping import mapping_for

    generator = torch.Generator(device="cuda").manual_seed(seed)
    named = []
    for unit in mapping_for(model_cfg, spec="local").units():
        for name, shape in zip(unit.hf_names, unit.rule.hf_shapes):
            dtype = torch.float32 if name == "lm_head.weight" else torch.bfloat16
            scale, offset = (0.1, 1.0) if len(shape) == 1 else (0.02, 0.0)  # norms near 1, matrices small
            tensor = torch.randn(shape, generator=generator, device="cuda") * scale + offset
            named.append((name, tensor.to(dtype)))
    return named


def run(out_file: str, url: str, preset_name: str, probe: list[int], transport: str, bucket_mb: int,
        rounds: int) -> None:
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.rollout.client import EngineClient
    from mpo.rollout.weight_sync import WeightSync, probe_logprobs

    ctx = initialize_parallel(ParallelConfig())
    assert ctx.device.backend == "nccl"
    cfg = preset(preset_name)
    client = EngineClient(url, timeout_s=600.0)
    weights = {"a": _random_weights(cfg, seed=1), "b": _random_weights(cfg, seed=2)}
    if transport == "nccl":
        sync = WeightSync([client], engine="sglang", transport="distributed", bucket_bytes=bucket_mb << 20,
                          timeout_s=600.0)
    else:
        sync = _cuda_ipc_sync_class()([client], engine="sglang", transport="tensor", bucket_bytes=bucket_mb << 20,
                                      timeout_s=600.0)
    results: dict = {"parameters": sum(t.numel() for _, t in weights["a"]),
                     "bytes": sum(t.numel() * t.element_size() for _, t in weights["a"]), "probe": {}}
    # a, b, then a again: the probe must move with the weights and come back exactly (nothing else is kept).
    for step, which in enumerate("aba"):
        sync.push(weights[which], version=f"{transport}-{step}{which}")
        results["probe"][f"{step}{which}"] = probe_logprobs(client, probe)
    results["seconds"] = [sync.push(weights["a"], version=f"{transport}-t{i}").seconds for i in range(rounds)]
    results["median_s"] = statistics.median(results["seconds"])
    sync.close()
    torch.save(results, out_file)
    torch.distributed.destroy_process_group()
