"""The critic of PPO (GAE) and VAPO (decoupled GAE): a megatron value model at the policy's parallel layout, its own
optimizer, values for the old rollouts, token advantages and returns, and the clipped value-loss update.

Values live on the last pipeline stage, so advantages are computed there, per data-parallel rank, after the old
forward, and whitened over every DP rank's tokens (one all-reduce): the same numbers one big batch would give.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpo.algorithms import all_reduce_metrics, compute_global_denominators, merge_metrics, value_loss
from mpo.algorithms.token_advantages import compute_token_advantages
from mpo.models.forward import MicroBatch, run_microbatches
from mpo.parallel.collectives import all_reduce_
from mpo.trainer.lr_schedule import LrSchedule, optimizer_settings


class Critic:
    """Value model + optimizer on this rank; every method is collective over the trainer's ranks."""

    def __init__(self, trainer: Any) -> None:
        from mpo.models.builder import PrecisionConfig, build_model, unwrap
        from mpo.models.ddp import ddp_options, make_optimizer, wrap_ddp
        from mpo.models.value_head import attach_value_head

        config = trainer.config
        precision = PrecisionConfig(dtype=config.model.dtype, fp32_lm_head=config.model.fp32_lm_head)
        model = build_model(trainer.model_cfg, config.parallel, trainer.ctx.device, precision, seed=config.seed,
                            recompute=config.model.recompute)
        # Initialised from the policy: its body as it is now (the checkpoint it loaded, or the same seeded init).
        unwrap(model).load_state_dict(trainer.gpt.state_dict())
        attach_value_head(model)
        self.model = wrap_ddp(model, **ddp_options(config.parallel, trainer.ctx.device))
        self.gpt = unwrap(model)
        lr = config.algorithm.critic_lr
        self.optimizer = make_optimizer(self.model, clip_grad=config.schedule.clip_grad,
                                        bf16=config.model.dtype == "bf16", **optimizer_settings(config.schedule, lr=lr))
        self.lr_schedule = LrSchedule(self.optimizer, config.schedule, lr=lr)  # the policy's shape, its own peak
        self.trainer = trainer

    def _run(self, microbatches: list[MicroBatch], loss_fn=None) -> list[dict]:
        return run_microbatches(self.model, microbatches, vocab_size=self.trainer.model_cfg.vocab_size,
                                loss_fn=loss_fn, values=True)

    def advantages(self, microbatches: list[MicroBatch]) -> dict[str, float]:
        """Old values, then token advantages and returns into each micro-batch's extras (last stage)."""
        outs = self._run(microbatches)
        if not outs:
            return {}
        algo = self.trainer.config.algorithm
        # per sample (the sample layout: also for packed micro-batches, whose values arrive unpacked)
        seq = max(mb.extras["mask"].shape[1] for mb in microbatches)

        def stacked(key: str) -> torch.Tensor:
            rows = [torch.nn.functional.pad(mb.extras[key].to(torch.float64), (0, seq - mb.extras[key].shape[1]))
                    for mb in microbatches]
            return torch.cat(rows)

        for mb, out in zip(microbatches, outs):
            mb.extras["values_old"] = out["values"]
        mask, values_old = stacked("mask"), stacked("values_old")
        rewards = torch.cat([mb.extras["rewards"].to(torch.float64) for mb in microbatches])
        result = compute_token_advantages(algo.advantage, rewards, mask, values=values_old,
                                          process_group=self.trainer.dp_group, **algo.advantage_args)
        start = 0
        for mb in microbatches:
            b, s = mb.extras["mask"].shape
            mb.extras["advantages"] = result.advantages[start:start + b, :s].to(mb.extras["advantages"].dtype)
            mb.extras["returns"] = result.returns[start:start + b, :s]
            start += b
        sums = torch.stack([(mask * values_old).sum(), (mask * result.returns).sum(), mask.sum()]).to(torch.float64)
        all_reduce_(sums, group=self.trainer.dp_group)
        return {"critic/values_old_mean": (sums[0] / sums[2].clamp(min=1)).item(),
                "critic/returns_mean": (sums[1] / sums[2].clamp(min=1)).item()}

    def update(self, microbatches: list[MicroBatch]) -> dict[str, float]:
        """One optimizer step of the clipped value loss (token-mean over the mini-batch's response tokens)."""
        algo = self.trainer.config.algorithm
        denominators = compute_global_denominators(
            [mb.extras["mask"][: mb.extras["n_real"]] for mb in microbatches], process_group=self.trainer.dp_group)

        def loss_fn(mb: MicroBatch, values: torch.Tensor, _):
            loss, metrics = value_loss(values, mb.extras["values_old"], mb.extras["returns"], mb.extras["mask"],
                                       clip=algo.value_clip, denominators=denominators)
            return loss, {f"critic/{k}": v.detach() for k, v in metrics.items()}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = self._run(microbatches, loss_fn)
        metrics: dict[str, float] = {}
        if outs:
            merged = merge_metrics([{k: v for k, v in o.items() if k != "values"} for o in outs])
            merged = all_reduce_metrics(merged, self.trainer.dp_group)
            metrics = {("critic/value_loss" if k == "loss" else k): float(v) for k, v in merged.items()}
        _, grad_norm, _ = self.optimizer.step()
        metrics["critic/grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        return metrics
