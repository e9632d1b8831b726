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
    from mpo.models.hf_mapping import mapping_for
    from mpo.weight_sync.verify import weights_checksum

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
    from mpo.models.hf_mapping import mapping_for
    from mpo.models.full_state import gather_full_state
    from mpo.rollout.client import EngineClient
    from mpo.bench._util import push_whole
    from mpo.weight_sync.transports import WeightSync
    from mpo.weight_sync.verify import verify_checksum, weights_checksum

    model, cfg = _perturbed_model()
    named = list(mapping_for(cfg, spec="local").full_state_to_hf(gather_full_state(model)))
    clients = [EngineClient(url, api_key=api_key) for url in ([urls] if isinstance(urls, str) else urls)]
    sync = WeightSync(clients, engine="mpo", transport=transport, bucket_bytes=bucket_bytes)
    report = push_whole(sync, named, version=1)
    verify_checksum(sync.clients, weights_checksum(named))
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


def covering_probe_in_the_loop(out_dir: str) -> None:
    """The RL loop's probe verification (mpo.weight_sync.publisher.Publisher.verify_by_probe) on the real Trainer (2
    gloo ranks, EP2) against its local mpo engine, which serves SGLang's probe API (input_token_logprobs, routed
    experts): after the loop's own sync it passes; with one expert of the last layer made stale on the engine it
    must fail on rank 0 (after every collective, so the ranks stay in step); with that expert restored it passes."""
    import json

    from mpo.models.full_state import gather_full_state
    from mpo.models.hf_mapping import mapping_for
    from helpers.trainer_worker import _worker_run
    from mpo.rollout.client import EngineError
    from mpo.bench._util import push_whole
    from mpo.weight_sync.transports import WeightSync

    with _worker_run(out_dir, "covering_probe", ["schedule.sft_steps=0"]) as (trainer, _, engines, weights, results):
        results["fresh"] = weights.verify_by_probe()
        full = gather_full_state(trainer.gpt)
        layer, expert = trainer.model_cfg.num_layers - 1, trainer.model_cfg.num_experts - 1
        if engines is not None:
            prefix = f"model.layers.{layer}.mlp.experts.{expert}."
            named = [(n, t) for n, t in mapping_for(trainer.model_cfg, spec="local").full_state_to_hf(full)
                     if n.startswith(prefix)]
            generator = torch.Generator().manual_seed(7)
            stale = [(n, t + 0.05 * torch.randn(t.shape, generator=generator)) for n, t in named]
            push_whole(WeightSync(engines.clients, engine="mpo"), stale, version=2)
            results["stale_tensors"] = len(stale)
        try:
            weights.verify_by_probe()
            results["stale_error"] = None
        except EngineError as exc:
            results["stale_error"] = str(exc)
        if engines is not None:
            push_whole(WeightSync(engines.clients, engine="mpo"), named, version=3)
            results["probe_tokens"] = sum(map(len, weights.probes))
        results["restored"] = weights.verify_by_probe()
        json.dumps(results)
