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
    from checkpoints_tools.mapping import mapping_for
    from mpo.rollout.weight_sync import weights_checksum

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
    torch.save({"logprobs": logprobs, "routes": routes, "checksum": weights_checksum(
        mapping_for(cfg, spec="local").full_state_to_hf(gather_full_state(model)))},
               Path(out_file))
    torch.distributed.destroy_process_group()


def _perturbed_model():
    """The tiny preset at seed 1234, then perturbed as an optimizer step would move it (deterministic)."""
    from mpo.models.builder import build_model
    from mpo.models.config import preset as get_preset
    from mpo.parallel import ParallelConfig, initialize_parallel

    ctx = initialize_parallel(ParallelConfig())
    cfg = get_preset("tiny")
    model = build_model(cfg, ctx.parallel, ctx.device, seed=1234)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model, cfg


def perturb_and_sync(out_file: str, urls: str | list[str], api_key: str, bucket_bytes: int,
                     transport: str = "tensor") -> None:
    """Trainer side of the weight-sync tests: push the perturbed model to the engines over `transport` in small
    buckets and verify their checksums."""
    from checkpoints_tools.mapping import mapping_for
    from mpo.models.full_state import gather_full_state
    from mpo.rollout.client import EngineClient
    from mpo.rollout.weight_sync import WeightSync, weights_checksum

    model, cfg = _perturbed_model()
    named = list(mapping_for(cfg, spec="local").full_state_to_hf(gather_full_state(model)))
    clients = [EngineClient(url, api_key=api_key) for url in ([urls] if isinstance(urls, str) else urls)]
    sync = WeightSync(clients, engine="mpo", transport=transport, bucket_bytes=bucket_bytes)
    report = sync.push(named, version="v1")
    sync.verify(named)
    sync.close()
    torch.save({"buckets": report.buckets, "bytes_per_s": report.bytes_per_s, "checksum": weights_checksum(named)},
               Path(out_file))
    torch.distributed.destroy_process_group()


def score_perturbed(out_file: str, sequence: list[int]) -> None:
    """Log-probs of `sequence` under the perturbed weights perturb_and_sync pushed."""
    from mpo.models.forward import MicroBatch, run_microbatches

    model, cfg = _perturbed_model()
    out = run_microbatches(model, [MicroBatch(torch.tensor([sequence]))], vocab_size=cfg.vocab_size)
    torch.save(out[0]["logprobs"][0], Path(out_file))
    torch.distributed.destroy_process_group()
