"""Per-rank body of the loop layout tests: the real Trainer's first RL step at several layouts, from one converted
checkpoint, on fixed rollouts with variable-length prompts and responses.

Rank 0's rollouts are replaced by fixed samples (no engine: what is compared is the trainer's step), so every layout
trains on exactly the same rows. Each layout writes the step's loss, the old log-probs of every response and the
full gradients (gathered from the shards) to `<out_dir>/<layout>.pt`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 256


def fixed_samples(seed: int = 3) -> list:
    """3 prompts x 2 responses: prompt lengths 3..9, response lengths 1..8, rewards/advantages not all equal."""
    from mpo.trainer.rows import Sample

    rng = random.Random(seed)
    samples = []
    for group in range(3):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 9))]
        for g in range(2):
            response = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 8))]
            advantage = (1.0 if g == 0 else -1.0) * (0.5 + group)
            samples.append(Sample(ids=prompt + response, prompt_len=len(prompt), group=group,
                                  reward=float(g == 0), advantage=advantage,
                                  rollout_logprobs=[-3.0 - 0.1 * i for i in range(len(response))]))
    return samples


def _old_logprobs_by_row(trainer, microbatches) -> list[tuple[tuple[int, ...], list[float]]]:
    rows = []
    if not trainer.is_last_stage:
        return rows
    for mb in microbatches:
        for i, sample in enumerate(mb.extras["samples"][: mb.extras["n_real"]]):
            n = len(sample.ids)
            rows.append((tuple(sample.ids), mb.extras["logp_old"][i, sample.prompt_len:n].tolist()))
    return rows


def run(out_dir: str, hf_dir: str, mcore_dir: str, layouts: dict[str, list[str]]) -> None:
    from mpo.cli import RECIPES
    from mpo.config import load_config
    from mpo.models.full_state import gather_full_state
    from mpo.trainer.trainer import Trainer

    samples = fixed_samples()
    for name, overrides in layouts.items():
        config = load_config(RECIPES / "demo_cpu.yaml", [
            f"model.hf_dir={hf_dir}", f"model.mcore_dir={mcore_dir}", f"logging.out_dir={out_dir}/{name}",
            "parallel.expert_parallel=1", "schedule.clip_grad=0", "schedule.micro_batch_size=2",
            "data.prompts_per_step=3", "rollout.samples_per_prompt=2", "algorithm.loss=grpo",
            "algorithm.filter_zero_variance=false", f"world_size={os.environ['WORLD_SIZE']}", *overrides])
        trainer = Trainer(config)
        world = dist.get_world_size()
        trainer.collect = lambda step: (samples, {})  # noqa: B023 - fixed rollouts, same on every layout
        captured: list = []
        original = trainer._old_forward

        def old_forward(microbatches, _original=original, _trainer=trainer):
            out = _original(microbatches)
            captured.extend(_old_logprobs_by_row(_trainer, microbatches))
            return out

        trainer._old_forward = old_forward
        metrics = trainer.train_step(0)
        grads = gather_full_state(trainer.gpt, grads=True)
        rows: list = [None] * world
        dist.all_gather_object(rows, captured)
        if dist.get_rank() == 0:
            old = {ids: lp for rank_rows in rows for ids, lp in rank_rows}
            torch.save({"loss": metrics["loss"], "old_logprobs": old, "grads": grads,
                        "grad_norm": metrics["grad_norm"]}, Path(out_dir) / f"{name}.pt")
        dist.barrier()
        del trainer
    dist.destroy_process_group()
