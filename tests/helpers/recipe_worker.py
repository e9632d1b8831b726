"""Per-rank body of the shipped-recipes test: every recipe in mpo/recipes/, with its model swapped for a tiny
checkpoint and its world shrunk to 2 ranks, runs one RL step with its own data, reward, engine kind and sync
transport (the step's new weights pushed to the engine and verified).

Engines are shared across recipes (one mpo engine, one SGLang server: both serve the same tiny HF directory), as a
cluster's engines outlive one job's config; each recipe builds its own Trainer and weight-update group.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

# What shrinks a 16-GPU recipe onto 2 CPU ranks; everything else (loss, advantage, replay, data, reward, engine kind,
# sync transport, critic, correction) stays the recipe's.
SHRINK = ["world_size=2", "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1", "parallel.expert_parallel=2",
          "parallel.expert_tensor_parallel=null", "parallel.num_layers_in_first_stage=null",
          "parallel.num_layers_in_last_stage=null", "parallel.virtual_pipeline_parallel=null",
          "model.dtype=fp32", "model.recompute=false", "rollout.engine_dtype=fp32", "rollout.tensor_parallel=1",
          "rollout.max_new_tokens=6", "rollout.samples_per_prompt=2", "sync.bucket_mb=4", "data.prompts_per_step=2",
          "schedule.updates_per_step=1", "schedule.micro_batch_size=8", "schedule.sft_steps=0",
          "logging.tensorboard=false", "logging.progress=false",
          # the suite's one SGLang server serves the tiny model unquantized: a recipe for FP8 engines (DeepSeek-V3's)
          # pushes bf16 here (fp8_block into mpo's engine: tests/test_fp8_block.py)
          "rollout.engine_weights=bf16"]


def run(out_dir: str, hf_dir: str, mcore_dir: str, recipes: list[str], urls: dict[str, str]) -> None:
    from mpo.config_checks import load_config
    from mpo.trainer.loop import engine_set
    from mpo.trainer.loop import publisher
    from mpo.trainer.rollouts import Rollouts
    from mpo.trainer.trainer import Trainer

    results: dict = {}
    for recipe in recipes:
        name = Path(recipe).stem
        probe = load_config(recipe)
        config = load_config(recipe, [*SHRINK, f"model.hf_dir={hf_dir}", f"model.mcore_dir={mcore_dir}",
                                      f"logging.out_dir={out_dir}/{name}",
                                      f"rollout.urls=[{urls[probe.rollout.engine]}]"])
        trainer = Trainer(config)
        rollouts = Rollouts.beside(trainer)
        engines = engine_set(config, Path(out_dir) / name) if trainer.rank == 0 else None
        if engines is not None:
            rollouts.collector.connect(engines.handles)
        weights = publisher(trainer, engines, rollouts)
        try:
            metrics = trainer.train_step(0, rollouts.collect)
            metrics.update(weights.publish(1))
        finally:
            weights.close()  # its weight-update session, before the engines stop
            rollouts.close()
            if engines is not None:
                engines.stop()
        results[name] = {"engine": config.rollout.engine, "sync": config.sync.transport, "task": config.data.task,
                         "step": metrics}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out_dir, "recipes.json").write_text(json.dumps(results))
    dist.destroy_process_group()
