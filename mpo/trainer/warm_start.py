"""The supervised warm start: teacher-forced steps on the task's answers before RL (schedule.sft_steps), so RL starts
from a policy that sometimes succeeds. The run loop calls it with the rollout side's task; the trainer takes each
step (Trainer.supervised_update) and counts them in its checkpoints (sft_steps_done)."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from mpo.models.forward import MicroBatch
from mpo.parallel.collectives import all_reduce_, broadcast_object
from mpo.trainer.rows import Sample

log = logging.getLogger(__name__)


def _sft_loss(trainer, share: float) -> float:
    """Collective: a warm-start step's loss on every rank, from this rank's share (the last stage's shares summed over
    data parallelism; the last global rank is on the last stage)."""
    if trainer.is_last_stage:
        share = all_reduce_(torch.tensor([share], dtype=torch.float64), group=trainer.dp_group).item()
    return broadcast_object(share, src=dist.get_world_size() - 1, group=trainer.ctx.object_group)


def supervised_warm_start(trainer, task, every: int = 0) -> float:
    """Teacher-forced steps on `task`'s answers (rank 0's task reads them): from trainer.sft_steps_done (0, or a
    resumed checkpoint's) to schedule.sft_steps; rank 0 logs the loss every `every` steps (and the first and last).
    Returns the last step's loss."""
    cfg = trainer.config
    steps = cfg.schedule.sft_steps
    for group in trainer.optimizer.param_groups:
        group["lr"] = cfg.schedule.sft_lr
    loss_value = float("nan")
    started, first = time.perf_counter(), trainer.sft_steps_done
    for step in range(first, steps):
        pairs = task.warm_start_prompts(step, 64) if trainer.rank == 0 else None
        pairs = broadcast_object(pairs, group=trainer.ctx.object_group)  # rank 0 reads the data
        samples = [Sample(ids=[*ids, *answer], prompt_len=len(ids), group=0, reward=0.0) for ids, answer in pairs]
        mbs = trainer.pass_microbatches([samples])[0]
        total = float(sum(len(answer) for _, answer in pairs))

        def loss_fn(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
            loss = -(logprobs * mb.extras["mask"]).sum() / total
            return loss, {"sft_loss": loss.detach()}

        outs = trainer.supervised_update(mbs, loss_fn)
        # this rank's share of the global loss (each share divides by every rank's tokens)
        share = sum(float(o["sft_loss"]) for o in outs) if outs else float("nan")
        shown = bool(every) and (step == first or (step + 1) % every == 0)
        if shown or step + 1 == steps:  # the same steps on every rank: the loss is a collective
            loss_value = _sft_loss(trainer, share)
            if trainer.rank == 0:
                log.info("warm start step %d/%d: loss %.4f (%.2f s/step)", step + 1, steps, loss_value,
                         (time.perf_counter() - started) / (step + 1 - first))
    for group in trainer.optimizer.param_groups:
        group["lr"] = cfg.schedule.lr
    return loss_value
