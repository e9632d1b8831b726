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


def long_samples(model_cfg, *, routes: bool = False, seed: int = 5) -> list:
    """Packing layouts: 4 prompts x 2 responses, prompt lengths 3..40, response lengths 1..200 (one of each extreme);
    with `routes`, engine routes for R3 (distinct random experts per token and layer)."""
    import numpy as np

    from mpo.trainer.rows import Sample

    rng = random.Random(seed)
    prompt_lens, response_lens = [3, 40, 17, 9], [1, 200, 57, 120, 4, 33, 150, 12]
    samples = []
    for group, p_len in enumerate(prompt_lens):
        prompt = [rng.randrange(4, VOCAB) for _ in range(p_len)]
        for g in range(2):
            response = [rng.randrange(4, VOCAB) for _ in range(response_lens[2 * group + g])]
            ids = prompt + response
            engine_routes = None
            if routes:
                shape = (len(ids) - 1, model_cfg.num_layers)
                engine_routes = np.array([[rng.sample(range(model_cfg.num_experts), model_cfg.router_topk)
                                           for _ in range(shape[1])] for _ in range(shape[0])], dtype=np.int32)
            samples.append(Sample(ids=ids, prompt_len=len(prompt), group=group, reward=float(g == 0),
                                  advantage=(1.0 if g == 0 else -1.0) * (0.5 + group), routes=engine_routes,
                                  rollout_logprobs=[-3.0 - 0.01 * i for i in range(len(response))]))
    return samples


def isolation(trainer) -> dict[str, float] | None:
    """Packed attention stays inside each sequence: perturb the first of two packed sequences, the second's
    log-probs do not move (and the first's do, so the probe is not vacuous); the second equals itself run alone from
    position 0. One micro-batch on this rank."""
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.trainer.packing import packed_microbatch
    from mpo.trainer.rows import Sample

    rng = random.Random(11)
    a = [rng.randrange(4, VOCAB) for _ in range(30)]
    b = [rng.randrange(4, VOCAB) for _ in range(25)]
    a_perturbed = [rng.randrange(4, VOCAB) for _ in a[:-1]] + a[-1:]
    outs = []
    for first in (a, a_perturbed):
        rows = [Sample(ids=first, prompt_len=1, group=0, reward=0.0), Sample(ids=b, prompt_len=1, group=0, reward=0.0)]
        mb = packed_microbatch(rows, 2, 64, thd=trainer.ctx.device.layer_spec == "te").to(trainer.device)
        out = run_microbatches(trainer.model, [mb], vocab_size=trainer.model_cfg.vocab_size, forward_only=True)
        outs.append(out[0]["logprobs"] if out else None)
    # the second sequence alone, positions from 0 (RoPE over the packed row's continuous positions must agree)
    alone = run_microbatches(trainer.model, [MicroBatch(torch.tensor([b])).to(trainer.device)],
                             vocab_size=trainer.model_cfg.vocab_size, forward_only=True)
    if outs[0] is None:
        return None
    return {"other_maxdiff": (outs[0][1] - outs[1][1]).abs().max().item(),
            "perturbed_maxdiff": (outs[0][0] - outs[1][0]).abs().max().item(),
            "alone_maxdiff": (outs[0][1, : len(b)] - alone[0]["logprobs"][0]).abs().max().item()}


def _old_logprobs_by_row(trainer, microbatches) -> list[tuple[tuple[int, ...], list[float]]]:
    rows = []
    if not trainer.is_last_stage:
        return rows
    for mb in microbatches:
        for i, sample in enumerate(mb.extras["samples"][: mb.extras["n_real"]]):
            n = len(sample.ids)
            # ids as plain ints: a rank other than 0 receives them as a numpy array (mpo.trainer.distribute)
            rows.append((tuple(int(t) for t in sample.ids), mb.extras["logp_old"][i, sample.prompt_len:n].tolist()))
    return rows


def run(out_dir: str, hf_dir: str, mcore_dir: str, layouts: dict[str, list[str]]) -> None:
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.models.full_state import gather_full_state
    from mpo.trainer.trainer import Trainer

    for name, overrides in layouts.items():
        config = load_config(RECIPES / "demo_cpu.yaml", [
            f"model.hf_dir={hf_dir}", f"model.mcore_dir={mcore_dir}", f"logging.out_dir={out_dir}/{name}",
            "parallel.expert_parallel=1", "schedule.clip_grad=0", "schedule.micro_batch_size=2",
            "data.prompts_per_step=3", "rollout.samples_per_prompt=2", "algorithm.loss=grpo",
            "algorithm.filter_zero_variance=false", f"world_size={os.environ['WORLD_SIZE']}",
            *(["data.prompts_per_step=4"] if name.startswith("packed") else []), *overrides])
        trainer = Trainer(config)
        # layouts named packed-*: the long-tailed rows (with engine routes under R3) instead of the short ones
        samples = long_samples(trainer.model_cfg, routes="r3" in name) if name.startswith("packed") else \
            fixed_samples()
        world = dist.get_world_size()
        captured: list = []
        original = trainer.policy.old_forward

        def old_forward(microbatches, _original=original, _trainer=trainer):
            out = _original(microbatches)
            captured.extend(_old_logprobs_by_row(_trainer, microbatches))
            return out

        trainer.policy.old_forward = old_forward
        metrics = trainer.train_step(0, lambda step: (samples, {}))  # noqa: B023 - fixed rollouts, every layout's
        grads = gather_full_state(trainer.gpt, grads=True)
        probe = isolation(trainer) if name == "packed-dp2" else None
        rows: list = [None] * world
        dist.all_gather_object(rows, captured)
        if dist.get_rank() == 0:
            old = {ids: lp for rank_rows in rows for ids, lp in rank_rows}
            torch.save({"loss": metrics["loss"], "old_logprobs": old, "grads": grads,
                        "grad_norm": metrics["grad_norm"], "isolation": probe,
                        "metrics": {k: float(v) for k, v in metrics.items()}}, Path(out_dir) / f"{name}.pt")
        dist.barrier()
        del trainer
    dist.destroy_process_group()
