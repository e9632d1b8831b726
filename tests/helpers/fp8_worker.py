"""Per-rank body of the block-FP8 streaming sync test (tests/test_fp8_block.py): the real Trainer at PP2 (two senders,
gloo) publishing with rollout.engine_weights=fp8_block to a real local mpo engine over HTTP, its weights then
compared with ones computed here independently from a full gather of the trainer (test-only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist


def fp8_streaming(out_dir: str, transports: list[str]) -> None:
    """For each transport ("shm", or "tensor/gloo": pieces over gloo, no shared memory): perturb the weights, publish
    in fp8_block (which verifies the engine's checksum itself), then record on rank 0 whether the engine's checksum
    equals that of dequantize(quantize(w)) for every weight block FP8 quantizes (w itself for the rest), whether it
    differs from the unquantized weights', and the sync's bytes next to the bytes of both formats."""
    from helpers.sync_worker import forbid_full_gather, perturb
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.models.full_state import gather_full_state
    from mpo.models.hf_mapping import mapping_for
    from mpo.trainer.loop import engine_set
    from mpo.trainer.loop import publisher
    from mpo.trainer.trainer import Trainer
    from mpo.weight_sync.fp8 import dequantize_block, is_quantized, quantize_block, wire_bytes
    from mpo.weight_sync.verify import weights_checksum

    results: dict = {}
    owner = trainer = None
    for i, item in enumerate(transports):
        transport, _, gather = item.partition("/")
        urls = [f"rollout.urls=[{owner.clients[0].url}]", f"rollout.api_key={owner.api_key}"] if owner else []
        config = load_config(RECIPES / "demo_cpu.yaml", [
            f"logging.out_dir={out_dir}/{transport}", "world_size=2", "parallel.expert_parallel=1",
            "parallel.pipeline_parallel=2", f"sync.transport={transport}", "sync.bucket_mb=1",
            "schedule.sft_steps=0", "rollout.engine_weights=fp8_block", *urls,
            f"sync.host_shared_memory={'false' if gather == 'gloo' else 'true'}"])
        trainer = trainer or Trainer(config)
        trainer.config = config
        engines = engine_set(config, Path(out_dir, transport)) if dist.get_rank() == 0 else None
        owner = owner or engines
        weights = publisher(trainer, engines)
        try:
            perturb(trainer.gpt, scale=0.05 * (i + 1))
            with forbid_full_gather():
                metrics = weights.publish(i + 1)  # raises unless the engine's checksum is the trainer's digests'
            full = gather_full_state(trainer.gpt)
            if engines is not None:
                named = list(mapping_for(trainer.model_cfg, spec="local").full_state_to_hf(full))
                fp8 = [(n, dequantize_block(*quantize_block(t)) if is_quantized(n, t.shape) else t) for n, t in named]
                got = engines.clients[0].call("/weights_checksum", method="GET")["checksum"]
                results[item] = {
                    "metrics": metrics, "engine_is_fp8": got == weights_checksum(fp8),
                    "engine_is_unquantized": got == weights_checksum(named),
                    "quantized": sum(is_quantized(n, t.shape) for n, t in named),
                    "fp8_bytes": sum(wire_bytes(t.shape, t.element_size(), "fp8_block", n) for n, t in named),
                    "bf16_bytes": sum(t.numel() * t.element_size() for _, t in named),
                    "dtype": str(named[0][1].dtype)}
        finally:
            weights.close()
            if engines is not None and engines is not owner:
                engines.stop()
        dist.barrier()
    if owner is not None:
        owner.stop()
    if dist.get_rank() == 0:
        Path(out_dir, "fp8_sync.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
