"""The RL trainer, the policy side of a run (mpo.trainer.loop builds both sides): one instance per rank (torchrun),
holding the model, the optimizer, the algorithm and their checkpoints.

One step: rank 0 samples prompts gets G responses per prompt from the engines (log-probs and routed experts included),
scores them (with algorithm.dynamic_sampling, drawing further prompt groups until enough have non-zero reward
variance), computes advantages and drops zero-variance groups; rank 0 sends every rank its data-parallel share with
its stage's routes (mpo.trainer.distribute); an old-logprob forward records the routing (replaying the engines' routes
under R3); each mini-batch update runs the configured loss with global denominators (replaying the old routes under
R2); the new weights are pushed to the engines; metrics and, every few steps, a checkpoint are written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

from mpo.algorithms import CorrectionConfig, get_loss, make_loss_config
from mpo.algorithms.step_advantages import StepAdvantages
from mpo.config import TrainConfig, to_dict
from mpo.config_checks import model_config, resolve_rollout_correction
from mpo.model_files import copy_model_files, resolve_mcore_dir
from mpo.model_import import refuse_without_weights
from mpo.models.forward import MicroBatch, run_microbatches
from mpo.parallel.collectives import one_rank
from mpo.trainer.critic import Critic
from mpo.trainer.dist_checkpoint import DistCheckpointer, Part, layout_of
from mpo.trainer.distribute import Distributor
from mpo.trainer.lr_schedule import LrSchedule, optimizer_settings, steps_change_line
from mpo.trainer.offload import TrainerOffload, offload_enabled
from mpo.trainer.phases import PhaseClock
from mpo.trainer.rows import Sample, _microbatch_multiple, rank_microbatches, uniform_length
from mpo.trainer.update import PolicyUpdate

log = logging.getLogger(__name__)


# The rollout side's keys in trainer_state.json (Rollouts.state_dict), in the order checkpoints have always had them.
ROLLOUT_KEYS = ("advantage_state", "retirement", "task")


class NonFiniteStop(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        from megatron.core import parallel_state

        from mpo.models.builder import PrecisionConfig, build_model, unwrap
        from mpo.models.ddp import ddp_options, make_optimizer, wrap_ddp
        from mpo.parallel import initialize_parallel
        from mpo.routing import attach_routing_hooks

        self.config = config
        self.sft_steps_done = 0  # supervised warm-start steps taken (mpo.trainer.warm_start), kept in checkpoints
        self.clock = PhaseClock(enabled=config.logging.phase_times)  # time/<phase>_s per step (bench step_profile)
        refuse_without_weights(config, where="the trainer")  # never random weights in place of hf_dir's
        self.model_cfg = model_config(config)
        self.ctx = initialize_parallel(config.parallel, num_layers=self.model_cfg.num_layers,
                                       num_experts=self.model_cfg.num_experts,
                                       num_attention_heads=self.model_cfg.num_attention_heads, seed=config.seed)
        self.rank = self.ctx.rank
        self.device = self.ctx.device.device  # the compute device: micro-batches and collective buffers live here
        self.ps = parallel_state
        precision = PrecisionConfig(dtype=config.model.dtype, fp32_lm_head=config.model.fp32_lm_head)
        model = build_model(self.model_cfg, config.parallel, self.ctx.device, precision, seed=config.seed,
                            recompute=config.model.recompute)
        if config.model.mcore_dir:
            from mpo.safe_load import load_sharded  # dist_checkpointing.load that runs no code from the files

            # a converted checkpoint, or a trainer checkpoint (a step directory, or a run directory: its newest):
            # its policy weights only, a new run's start (its optimizer state and counters are not read)
            gpt = unwrap(model)
            wanted = gpt.sharded_state_dict()
            loaded = load_sharded(wanted, resolve_mcore_dir(config.model.mcore_dir))
            gpt.load_state_dict({k: loaded[k] for k in wanted})
        options = ddp_options(config.parallel, self.ctx.device)
        self.model = wrap_ddp(model, **options)
        if self.rank == 0:  # the one start-up line on what runs (megatron's own notices are quieted: mpo.quiet)
            log.info("model: megatron-core GPTModel, %s layer spec, %s%s on %s; optimizer: megatron Adam (%s)",
                     self.ctx.device.layer_spec, config.model.dtype,
                     " with an fp32 LM head" if config.model.fp32_lm_head else "", self.ctx.device.device,
                     "distributed, sharded over data parallel" if options["distributed_optimizer"] else "plain")
        self.gpt = unwrap(model)
        self.optimizer = make_optimizer(self.model, clip_grad=config.schedule.clip_grad,
                                        bf16=config.model.dtype == "bf16",
                                        **optimizer_settings(config.schedule, lr=config.schedule.lr))
        self.lr_schedule = LrSchedule(self.optimizer, config.schedule, lr=config.schedule.lr)
        self.routing = attach_routing_hooks(self.model)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.critic = None  # built by set_algorithm for gae / vapo
        self.set_algorithm(config.algorithm)
        self.step = 0
        self.nonfinite_in_row = 0
        self.nonfinite_total = 0
        async_save = config.logging.checkpoint_async
        self.checkpoints = DistCheckpointer(config.logging.out_dir, keep=config.logging.keep_checkpoints,
                                            async_save=self.ctx.device.is_gpu if async_save is None else async_save,
                                            format=config.logging.checkpoint_format,
                                            model_files=partial(copy_model_files, config.model))

    # -- set-up helpers ------------------------------------------------------------------------------------------
    def set_algorithm(self, algorithm) -> None:
        """Use another algorithm section (loss, replay, KL) from the next step on; the reference policy for KL is
        the weights at this moment. The rollout side follows with Rollouts.set_algorithm(config, advantages)."""
        self.config = replace(self.config, algorithm=algorithm)
        self._offload = None  # the critic or the KL reference may change below: TrainerOffload made anew
        loss_spec = get_loss(algorithm.loss)
        self.routing.router_logprobs = loss_spec.router_shift  # only RSPO / +rs read router log-probs
        kl = {"kl_coef": algorithm.kl_coef, "kl_estimator": algorithm.kl_estimator} if algorithm.kl_coef > 0 else {}
        loss_cfg = make_loss_config(algorithm.loss, **algorithm.loss_args, **kl)
        kind = resolve_rollout_correction(algorithm.rollout_correction, self.config.schedule.mode)
        correction = CorrectionConfig(kind, **algorithm.rollout_correction_args)
        self.advantages = StepAdvantages.for_algorithm(algorithm)
        if self.advantages.config.needs_critic and getattr(self, "critic", None) is None:
            self.critic = Critic(self)  # initialised from the policy as it is now
        self.reference = self._reference_state() if algorithm.kl_coef > 0 else None
        self.policy = PolicyUpdate(self.model, self.gpt, self.optimizer, self.routing, self.model_cfg, algorithm,
                                   loss_spec, loss_cfg, correction, self.reference, device=self.device,
                                   dp_group=self.dp_group, pp_group=self.pp_group, clock=self.clock,
                                   forward_rows=self.config.schedule.forward_micro_batch_size)

    def _reference_state(self) -> dict[str, torch.Tensor]:
        """The initial weights, kept on the host for the KL reference forward."""
        return {k: v.detach().clone() for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)}

    def _trainer_offload(self) -> TrainerOffload | None:
        """rollout.colocate's trainer side (mpo.trainer.offload) over this rank's policy, critic, optimizers and KL
        reference (their storages are walked at every offload); None when rollout.offload_trainer is off."""
        if not offload_enabled(self.config.rollout):
            return None
        if self._offload is None:
            parts = [self] + ([self.critic] if self.critic is not None else [])
            self._offload = TrainerOffload([p.model for p in parts], [p.optimizer for p in parts], device=self.device,
                                           extra=(self.reference or {}).values())
        return self._offload

    @property
    def is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage()

    # -- training ------------------------------------------------------------------------------------------------
    def row_multiple(self) -> int:
        """Row lengths are multiples of this: TP under sequence parallelism, and 2 x CP x TP under context
        parallelism (mpo.models.context_parallel.row_multiple: every row in 2 x CP chunks, each split over TP)."""
        from mpo.models.context_parallel import row_multiple

        return max(self.ps.get_tensor_model_parallel_world_size(), row_multiple())

    def uniform_seq_len(self, samples: list[Sample]) -> int | None:
        """The one [b, s] shape every micro-batch of a pass needs under PP, TP or CP (see rows.uniform_length)."""
        multiple = self.row_multiple()
        if self.ps.get_pipeline_model_parallel_world_size() == 1 and multiple == 1:
            return None
        return uniform_length(samples, multiple)

    def pass_microbatches(self, minis: list[list[Sample]], schedule=None) -> list[list[MicroBatch]]:
        """This rank's micro-batches of every mini-batch of one pass: packed by schedule.max_tokens_per_microbatch
        when it is set (balanced DP shares, mpo.trainer.packing), else padded rows (one [b, s] under PP or TP).
        `schedule`: another schedule section's batching (default: the config's; mpo.bench.packing compares two)."""
        schedule, (dp_rank, dp_size) = schedule or self.config.schedule, self._dp()
        if schedule.max_tokens_per_microbatch:
            from mpo.trainer.packing import pack_pass

            return pack_pass(minis, dp_rank=dp_rank, dp_size=dp_size, max_tokens=schedule.max_tokens_per_microbatch,
                             max_rows=schedule.micro_batch_size, tp=self.row_multiple(),
                             uniform=self.ps.get_pipeline_model_parallel_world_size() > 1,
                             multiple=_microbatch_multiple(), thd=self.ctx.device.layer_spec == "te",
                             device=self.device)
        seq_len = self.uniform_seq_len([s for mini in minis for s in mini])
        return [rank_microbatches(m, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=schedule.micro_batch_size,
                                  seq_len=seq_len, device=self.device) for m in minis]

    def _dp(self) -> tuple[int, int]:
        return self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()

    def step_batch(self, step: int, source) -> tuple[list[Sample], dict[str, float]]:
        """Step `step`'s samples on every rank (rank 0 collects them from `source`: step -> (samples, metrics)) and
        the rollout metrics (rank 0's)."""
        with self.clock("collect"):
            samples, rollout_metrics = source(step) if self.rank == 0 else (None, {})
        # Every other rank waits here while rank 0 generates: on the gloo object group (parallel.distributed_timeout_s),
        # which holds none of the offloaded storages; each rank receives its own share (mpo.trainer.distribute).
        with self.clock("broadcast"):
            samples = self.distributor()(samples, updates=self.config.schedule.updates_per_step,
                                          dp_size=self._dp()[1],
                                          packed=bool(self.config.schedule.max_tokens_per_microbatch))
        return samples, rollout_metrics

    def distributor(self):
        """This rank's Distributor (mpo.trainer.distribute); made on first use, a collective on every rank."""
        if getattr(self, "_distribute", None) is None:
            self._distribute = Distributor(self.ctx.object_group, dp_rank=self._dp()[0], layers=self.routing.layers,
                                           num_layers=self.model_cfg.num_layers,
                                           first_k_dense=self.model_cfg.first_k_dense)
        return self._distribute

    def train_step(self, step: int, source) -> dict[str, float]:
        """One RL step on every rank; returns the step's metrics (complete on rank 0). source: rank 0's step ->
        (samples, metrics): the schedule's (mpo.trainer.schedule) in loop.run, or Rollouts.collect."""
        cfg = self.config
        # Colocated engines share every rank's GPU: the trainer's memory is on the host while rank 0's engines generate
        # (mpo.trainer.schedule tells the protocol); the weight sync after this step reads the parameters resident.
        offload = self._trainer_offload()
        if offload is not None:
            offload.offload()
        try:
            samples, rollout_metrics = self.step_batch(step, source)
        finally:
            if offload is not None:
                offload.reload()
        started = time.perf_counter()  # training time from here: under one_step_off/async rollouts overlap it
        metrics: dict[str, float] = dict(rollout_metrics)
        metrics["lr"] = self.lr_schedule.set_step(step)  # every update of this step uses lr(step)
        if self.critic is not None:
            metrics["critic_lr"] = self.critic.lr_schedule.set_step(step)
        if offload is not None:
            metrics.update(offload.metrics())  # the reporting rank's (the first last-stage rank)
        metrics["nonfinite_total"] = float(self.nonfinite_total)
        if not samples:  # every group had equal rewards: no update; the loss row is 0 (no gradient was taken)
            metrics.update(skipped_no_signal=1.0, loss=0.0)
            return metrics
        updates = min(cfg.schedule.updates_per_step, len(samples))
        with self.clock("microbatch_build"):
            per_update = self.pass_microbatches([samples[u::updates] for u in range(updates)])
        flat = [mb for mbs in per_update for mb in mbs]
        with self.clock("old_logprob_pass"):
            old_records, old_metrics = self.policy.old_forward(flat)
        metrics.update(old_metrics)
        if self.critic is not None:
            metrics.update(self.critic.advantages(flat))
        critic_only = self.critic is not None and step < cfg.algorithm.critic_warmup_steps
        update_metrics = []
        offset = 0
        for mbs in per_update:
            records = old_records[offset : offset + len(mbs)]
            engine_routes = [mb.extras["engine_routes"] for mb in mbs] if cfg.algorithm.replay == "r3" else None
            with self.clock(f"update{len(update_metrics)}"):
                update = {} if critic_only else self.policy.update(mbs, records, cfg.data.prompts_per_step,
                                                                   engine_routes)
            self._count_nonfinite(update)
            if self.critic is not None:
                update.update(self.critic.update(mbs))
            update_metrics.append(update)
            offset += len(mbs)
            if self.nonfinite_in_row >= cfg.schedule.max_nonfinite_steps:
                break
        for key in update_metrics[-1]:
            values = [m[key] for m in update_metrics if key in m]
            metrics[key] = sum(values) / len(values)
        metrics["nonfinite_total"] = float(self.nonfinite_total)
        tokens = sum(len(s.ids) for s in samples)
        metrics["train_time_s"] = time.perf_counter() - started
        metrics["train_tokens_per_s"] = tokens / max(metrics["train_time_s"], 1e-9)
        # Metrics live on the last pipeline stage; rank 0 reports them.
        with self.clock("metrics_gather"):
            gathered: list = [metrics]
            if not one_rank(self.ctx.object_group):
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, metrics if self.is_last_stage else None,
                                       group=self.ctx.object_group)
        merged = next(m for m in gathered if m is not None)
        merged.update(rollout_metrics)
        return merged

    def _count_nonfinite(self, update: dict[str, float]) -> None:
        if "nonfinite_skipped" in update:  # an update ran (not a critic warm-up step)
            skipped = update["nonfinite_skipped"] > 0
            self.nonfinite_in_row = self.nonfinite_in_row + 1 if skipped else 0
            self.nonfinite_total += int(skipped)

    def supervised_update(self, microbatches: list[MicroBatch], loss_fn) -> list[dict]:
        """One supervised warm-start step (mpo.trainer.warm_start) over this rank's micro-batches with `loss_fn`;
        returns run_microbatches' outputs (the last stage's)."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = run_microbatches(self.model, microbatches, vocab_size=self.model_cfg.vocab_size, loss_fn=loss_fn)
        self.optimizer.step()
        self.sft_steps_done += 1
        return outs

    def stop_if_nonfinite(self, next_step: int, rollout_state: Callable[[], dict[str, Any]]) -> None:
        """After schedule.max_nonfinite_steps non-finite steps in a row: checkpoint (with `rollout_state()`, the
        rollout side's state as of the batch trained last), then stop saying why."""
        limit = self.config.schedule.max_nonfinite_steps
        if self.nonfinite_in_row >= limit:
            self.save(next_step, rollout_state(), wait=True)
            raise NonFiniteStop(f"{self.nonfinite_in_row} consecutive steps had a non-finite loss or gradient "
                                f"(schedule.max_nonfinite_steps={limit}); checkpoint saved at step {next_step}")

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def _checkpoint_parts(self) -> list:
        parts = [Part("", self.gpt, self.optimizer)]
        if self.critic is not None:
            parts.append(Part("critic.", self.critic.gpt, self.critic.optimizer))
        return parts

    def trainer_state(self, step: int, rollouts: dict[str, Any]) -> dict[str, Any]:
        """The run's own state (JSON): the step, counters, the rollout side's state (Rollouts.state_dict), the config
        and the layout."""
        return {"step": step, "nonfinite_total": self.nonfinite_total, "sft_steps_done": self.sft_steps_done,
                **{k: rollouts[k] for k in ROLLOUT_KEYS}, "layout": layout_of(self.ctx), "config": to_dict(self.config)}

    def save(self, step: int, rollouts: dict[str, Any], *, wait: bool = False) -> None:
        """Collective: a checkpoint of step `step` (mpo.trainer.dist_checkpoint) in logging.checkpoint_format, with
        `rollouts` (Rollouts.state_dict(), rank 0's counts) beside the trainer's state; the run's last save is the
        export: fully reshardable, finished before returning (as with `wait=True`); other async saves finish at the
        next save."""
        last = step >= self.config.schedule.steps
        self.checkpoints.save(step, self._checkpoint_parts(), self.trainer_state(step, rollouts), wait=wait or last,
                              export=last)

    def resume(self) -> tuple[int, dict[str, Any] | None]:
        """Load the newest checkpoint if there is one (a fully_reshardable one saved at any layout, a dp_reshardable
        one at its own); returns the step to continue from and the rollout side's state to load
        (Rollouts.load_state_dict; None without a checkpoint)."""
        parts = self._checkpoint_parts()
        # a damaged newest checkpoint falls back to an intact one
        path = self.checkpoints.resume_point(parts, group=self.ctx.object_group)
        if path is None:
            return 0, None
        trainer_state = self.checkpoints.load(path, parts, layout_of(self.ctx))
        changed = steps_change_line((trainer_state.get("config") or {}).get("schedule") or {}, self.config.schedule,
                                    int(trainer_state["step"]))
        if changed and self.rank == 0:  # extending a run re-shapes its decay: never silently
            log.warning(changed)
        self.nonfinite_total = int(trainer_state.get("nonfinite_total", 0))
        # checkpoints from before the key: all taken after the whole warm start
        self.sft_steps_done = int(trainer_state.get("sft_steps_done", self.config.schedule.sft_steps))
        log.info("resumed from %s (step %d)", path, trainer_state["step"])
        # advantages, retirement, the data position (rank 0's)
        return int(trainer_state["step"]), {k: trainer_state.get(k) for k in ROLLOUT_KEYS}
