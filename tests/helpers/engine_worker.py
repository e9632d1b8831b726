"""Trainer-side reference for engine tests: the mpo model built as the trainer builds it, scoring given sequences."""

from __future__ import annotations

from pathlib import Path

import torch


def score(out_file: str, sequences: list[list[int]], preset: str = "tiny", seed: int = 1234) -> None:
    from mpo.models.builder import build_model
    from mpo.models.config import preset as get_preset
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.models.full_state import gather_full_state
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.rollout.mpo_engine.model_runner import model_checksum

    ctx = initialize_parallel(ParallelConfig())
    cfg = get_preset(preset)
    from mpo.routing import attach_routing_hooks

    model = build_model(cfg, ctx.parallel, ctx.device, seed=seed)
    hooks = attach_routing_hooks(model)
    logprobs, routes = [], []
    for seq in sequences:  # one sequence per micro-batch: the trainer's shapes, not the engine's batch
        with hooks.session() as capture:
            out = run_microbatches(model, [MicroBatch(torch.tensor([seq]))], vocab_size=cfg.vocab_size)
        logprobs.append(out[0]["logprobs"][0])
        routes.append(capture.records[0].indices[0].to(torch.int32))  # [n, L, K]
    torch.save({"logprobs": logprobs, "routes": routes, "checksum": model_checksum(gather_full_state(model))},
               Path(out_file))
    torch.distributed.destroy_process_group()
