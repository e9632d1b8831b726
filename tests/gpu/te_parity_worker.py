"""Rank body of test_te_spec (and, local spec only, test_gpu_local_parity): the same converted checkpoint in the
local-spec and the TE-spec GPTModel on one GPU.

The device profile is the GPU's (NCCL, CUDA, grouped GEMM on) except for `layer_spec`, so the only difference
between the two models is the layer spec. Weights come from one torch_dist checkpoint written by checkpoints_tools
with both specs' key names (spec="both"), so this also proves the TE aliases of the mapping.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch


def run(out_file: str, mcore_dir: str, token_rows: list[list[int]], specs: tuple[str, ...] = ("local", "te")) -> None:
    from checkpoints_tools.convert import HF_CONFIG_NAME
    from mpo.models.hf_mapping import model_config_from_hf
    from checkpoints_tools.mcore_runner import load_checkpoint
    from mpo.models.builder import PrecisionConfig, build_model, unwrap
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.routing import attach_routing_hooks

    # fp32 must mean fp32 on both sides: no TF32 in torch's matmuls (TE's fp32 GEMMs do not use it either).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = model_config_from_hf(json.loads((Path(mcore_dir) / HF_CONFIG_NAME).read_text()))
    parallel = ParallelConfig(sequence_parallel=False)
    ctx = initialize_parallel(parallel, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                              num_attention_heads=cfg.num_attention_heads)
    assert ctx.device.is_gpu and ctx.device.backend == "nccl", ctx.device
    ids = torch.tensor(token_rows, device=ctx.device.device)
    results: dict = {}
    for dtype in ("fp32", "bf16"):
        for spec in specs:
            model = build_model(cfg, parallel, replace(ctx.device, layer_spec=spec),
                                PrecisionConfig(dtype=dtype, fp32_lm_head=True))
            load_checkpoint(unwrap(model), mcore_dir)
            model.eval()
            hooks = attach_routing_hooks(model)
            with torch.no_grad(), hooks.session() as capture:
                out = run_microbatches(model, [MicroBatch(ids)], vocab_size=cfg.vocab_size, keep_logits=True)[0]
            results[f"{spec}_{dtype}"] = {
                "logprobs": out["logprobs"].double().cpu(),
                "logits": out["logits"][..., : cfg.vocab_size].double().cpu(),
                "routes": capture.records[0].indices.cpu(),
                "modules": sorted({type(m).__name__ for m in unwrap(model).modules()}),
            }
            del model, hooks
            torch.cuda.empty_cache()
    torch.save(results, out_file)
    torch.distributed.destroy_process_group()
