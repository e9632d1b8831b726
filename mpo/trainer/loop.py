"""The run: set-up, optional supervised warm start, RL steps with weight sync, metrics, checkpoints, resume.

The loop builds and owns both sides of a run: the policy (mpo.trainer.trainer.Trainer) and the rollout side
(mpo.trainer.rollouts.Rollouts: task, Collector, rank 0's producer process), plus the engines and the weight
publisher that link them; checkpoints hand the rollout side's state to the trainer's save / resume explicitly."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch.distributed as dist

from mpo.config import TrainConfig
from mpo.config_checks import model_config
from mpo.lifecycle import freeze_startup_heap
from mpo.parallel.init import launch_rank
from mpo.rollout.engines import LOCAL_ENGINE_NICE, EngineSet
from mpo.trainer.evaluation import Evaluator, due
from mpo.trainer.metrics_log import MetricsLog, print_interval, run_summary, wandb_settings
from mpo.trainer.probes import trainer_probe_logprobs
from mpo.trainer.producer import ProducerProcess
from mpo.trainer.rollouts import Rollouts
from mpo.trainer.schedule import RolloutSchedule
from mpo.trainer.trainer import Trainer
from mpo.trainer.warm_start import supervised_warm_start

log = logging.getLogger(__name__)


def engine_settings(config: TrainConfig):
    """The settings local engines start with: what a run's model, rollout and sync sections describe."""
    from mpo.rollout.engine_command import EngineSettings

    return EngineSettings.from_config(config.model, config.rollout, config.sync, seed=config.seed)


def engine_set(config: TrainConfig, out_dir: Path, *, wait: bool = True) -> EngineSet:
    """Rank 0's engines for a run's config: its rollout section, and for local engines engine_settings(config)."""
    # Off-policy, a local engine generates while the ranks train on the same cores: at a lower priority it takes the
    # cycles the ranks leave idle instead of slowing them (EP/TP ranks wait for their slowest peer).
    nice = LOCAL_ENGINE_NICE if config.schedule.mode != "sync" else 0
    return EngineSet(config.rollout, out_dir, model_config(config), settings=engine_settings(config), nice=nice,
                     wait=wait)


def publisher(trainer: Trainer, engines: EngineSet | None, rollouts: Rollouts | None = None):
    """This rank's weight publisher for `trainer` (collective: every rank makes one), rank 0's with its engines; in
    sync mode `rollouts`' collects republish through it when their engines were all restarted."""
    from mpo.weight_sync.publisher import Publisher

    c = trainer.config
    weights = Publisher(c.rollout, c.sync, c.model, trainer.model_cfg, trainer.gpt, pause=c.schedule.mode != "sync",
                        seed=c.seed, stage=trainer.ps.get_pipeline_model_parallel_rank(),
                        device=trainer.ctx.device.device, object_group=trainer.ctx.object_group, engines=engines,
                        score_probes=functools.partial(trainer_probe_logprobs, trainer))
    distribute = trainer.distributor()  # collective when new, as this is
    distribute.on_republish = lambda: weights.publish(weights.version)
    if rollouts is not None and trainer.config.schedule.mode == "sync":
        rollouts.on_stale(distribute.republish)
    return weights


def _memory_hook(engines: EngineSet):
    """Colocated engines: release / resume every engine's memory (SGLang's memory-saver endpoints)."""

    def memory(action: str, tags: list[str] | None) -> None:
        for client in engines.clients:
            getattr(client, f"{action}_memory_occupation")(tags)

    return memory


def _evaluate(evaluator: Evaluator | None, step: int, metrics_log: MetricsLog | None) -> dict[str, float]:
    """Rank 0, when `eval` says the policy about to train `step` is evaluated: held-out metrics (eval.jsonl too)."""
    if evaluator is None or not due(evaluator.config, step):
        return {}
    metrics, rows = evaluator.run(step)
    metrics_log.log_eval(rows)
    log.info("evaluation before step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    return metrics


def _trained_state(schedule: RolloutSchedule | None, rollouts: Rollouts) -> dict:
    """The rollout state a checkpoint keeps: as of the batch trained last (RolloutSchedule.taken_state, off-policy,
    where the producer has drawn ahead), else the rollout side's own."""
    if schedule is not None and schedule.taken_state is not None:
        return schedule.taken_state
    return rollouts.state_dict()


def run(config: TrainConfig) -> None:
    """Train to config.schedule.steps on every rank (under torchrun); resumes from the newest checkpoint."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(levelname)s %(message)s")
    for noisy in ("httpx", "megatron"):  # one line per engine call / per parameter is noise at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    out_dir = Path(config.logging.out_dir)
    began = time.perf_counter()
    every = print_interval(config.logging)
    first_rank = launch_rank() == 0
    # Start-up takes a while (engines, models, a checkpoint to load): rank 0 says what it is doing, in a few lines.
    if first_rank and not config.rollout.urls:
        log.info("starting %d local engine%s (logs: %s)", config.rollout.num_engines,
                 "s" * (config.rollout.num_engines > 1), out_dir / "logs")
    # Rank 0 launches its local engines first: they start while the ranks build their models (seconds, paid by every
    # run and most tests), and are waited for once the trainer is up.
    engines = engine_set(config, out_dir, wait=False) if first_rank else None
    trainer: Trainer | None = None
    rollouts: Rollouts | None = None
    metrics_log = None
    evaluator: Evaluator | None = None
    schedule: RolloutSchedule | None = None
    producer: ProducerProcess | None = None
    weights = None
    try:
        if first_rank:
            log.info("building the model on %d rank%s", config.world_size, "s" * (config.world_size > 1))
        trainer = Trainer(config)
        rollouts = Rollouts.beside(trainer)
        start, rollout_state = trainer.resume()
        rollouts.load_state_dict(rollout_state)
        if engines is not None:
            waited = time.perf_counter()
            engines.wait_ready()
            if trainer.rank == 0:
                log.info("%d engine%s ready, %.0f s after start (%.1f s waited for once the model was built)",
                         len(engines.handles), "s" * (len(engines.handles) > 1), time.perf_counter() - began,
                         time.perf_counter() - waited)
            rollouts.collector.connect(engines.handles)
            if config.schedule.mode != "sync":  # started now: its imports overlap the warm start and first push
                producer = ProducerProcess(trainer.config, engines.handles, clock=trainer.clock,
                                           context_length=trainer.model_cfg.max_position_embeddings)
        weights = publisher(trainer, engines, rollouts)
        if start == 0 and trainer.sft_steps_done < config.schedule.sft_steps:
            if trainer.rank == 0:
                log.info("supervised warm start: %d steps%s", config.schedule.sft_steps,
                         f", from step {trainer.sft_steps_done}" if trainer.sft_steps_done else "")
            supervised_warm_start(trainer, rollouts.task, every or 10)  # its last step's loss is logged
            # A crash in RL's first steps does not repeat the warm start: its checkpoint, committed before RL begins
            if config.logging.checkpoint_every:
                trainer.save(0, rollouts.state_dict(), wait=True)
                if trainer.rank == 0:
                    log.info("warm start: checkpoint %s", trainer.checkpoints.root / "step_0")
        weights.publish(version=start)
        if trainer.rank == 0:
            metrics_log = MetricsLog(out_dir, tensorboard=config.logging.tensorboard, total_steps=config.schedule.steps,
                                     progress=config.logging.progress, start_step=start, wandb=wandb_settings(config),
                                     versions_per_token=config.logging.versions_per_token, print_every=every)
            metrics_log.truncate_after(start - 1)
            # Rank 0's rollout source: inline (sync) or a producer thread ahead of the trainer (one_step_off, async)
            # that waits on the producer process, which collects off this process's GIL (mpo.trainer.producer)
            if producer is not None:  # it continues from rank 0's rollout state (resumed, after the warm start)
                rollouts.hand_over(producer)  # rank 0's reward workers would idle: the producer's score from now on
            schedule = RolloutSchedule(rollouts.collect, config.schedule.mode, config.schedule.max_staleness,
                                       start=start, steps=config.schedule.steps, on_versions=metrics_log.log_versions,
                                       memory=_memory_hook(engines) if config.rollout.colocate else None,
                                       rows=lambda: rollouts.samples_log, state=rollouts.state_dict)
        if trainer.rank == 0 and config.eval.every:
            evaluator = Evaluator(config, engines.handles)
        freeze_startup_heap()  # the model, the optimizer and the warm start's leftovers: out of every collection
        for step in range(start, config.schedule.steps):
            with trainer.clock("eval"):
                held_out = _evaluate(evaluator, step, metrics_log)  # the policy the engines hold: `step`
            metrics = trainer.train_step(step, schedule.take if schedule is not None else None)
            metrics.update(held_out)
            if schedule is not None:
                schedule.before_sync()
            try:
                with trainer.clock("sync"):
                    metrics.update(weights.publish(version=step + 1))
            finally:
                if schedule is not None:
                    schedule.after_sync(step + 1)
            if schedule is not None:
                metrics.update(schedule.step_metrics())
            metrics.update(trainer.clock.take())  # rank 0's phases (time/<phase>_s with logging.phase_times)
            if metrics_log is not None:
                with trainer.clock("metrics_write"):
                    metrics_log.log(step, metrics)
                    metrics_log.log_samples(schedule.samples_log)
            trainer.stop_if_nonfinite(step + 1, lambda: _trained_state(schedule, rollouts))
            every = config.logging.checkpoint_every
            if (every and (step + 1) % every == 0) or step + 1 == config.schedule.steps:
                with trainer.clock("checkpoint"):
                    trainer.save(step + 1, _trained_state(schedule, rollouts))
        # The final policy: its own row, step = schedule.steps, eval metrics only (again on a rerun of a finished run,
        # whose resume dropped it with every row past the checkpoint).
        final = _evaluate(evaluator, config.schedule.steps, metrics_log)
        if final:
            metrics_log.log(config.schedule.steps, final, progress=False)
        if metrics_log is not None:
            metrics_log.close()  # the bar ends above the summary
            log.info("%s", run_summary(out_dir, first_step=start, steps=config.schedule.steps,
                                       seconds=time.perf_counter() - began))
    finally:
        if schedule is not None:  # first: a producer mid-batch is aborted before its engines stop
            schedule.stop(abort=lambda: [producer and producer.close()] + [c.abort_all() for c in engines.clients])
        try:
            if metrics_log is not None:
                metrics_log.close()
        finally:  # the engines stop even when closing the log fails (a full disk, say)
            if producer is not None:  # its reward workers with it (a producer not yet handed over too)
                producer.close()
            if rollouts is not None:
                rollouts.close()
            if evaluator is not None:
                evaluator.close()
            if weights is not None:
                weights.close()
            if engines is not None:
                engines.stop()
    dist.barrier()
