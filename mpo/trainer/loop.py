"""The run: set-up, optional supervised warm start, RL steps with weight sync, metrics, checkpoints, resume."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from mpo.config import TrainConfig, model_config
from mpo.lifecycle import freeze_startup_heap
from mpo.models.forward import MicroBatch, run_microbatches
from mpo.parallel.collectives import all_reduce_
from mpo.parallel.init import launch_rank
from mpo.rollout.engines import EngineSet
from mpo.trainer.evaluation import Evaluator, due
from mpo.trainer.metrics_log import MetricsLog, wandb_settings
from mpo.trainer.producer import ProducerProcess
from mpo.trainer.schedule import RolloutSchedule
from mpo.trainer.trainer import Trainer, _broadcast_object

log = logging.getLogger(__name__)


def _trainer_probe_logprobs(trainer: Trainer, probes: list[list[int]]) -> list[list[float]]:
    """Collective: the trainer's log-probs of every probe sequence, on every rank (computed by the last pipeline
    stage; sequences of one length share a micro-batch)."""
    by_length: dict[int, list[int]] = {}
    for j, probe in enumerate(probes):
        by_length.setdefault(len(probe), []).append(j)
    scored: list[list[float] | None] = [None] * len(probes)
    with torch.no_grad():
        for rows in by_length.values():
            batch = MicroBatch(torch.tensor([probes[j] for j in rows], device=trainer.device))
            outs = run_microbatches(trainer.model, [batch],
                                    vocab_size=trainer.model_cfg.vocab_size, forward_only=True)
            for row, j in enumerate(rows if outs else []):
                scored[j] = outs[0]["logprobs"][row].tolist()
    # the last global rank is on the last stage
    return _broadcast_object(scored, src=dist.get_world_size() - 1, group=trainer.ctx.object_group)


def publisher(trainer: Trainer, engines: EngineSet | None):
    """This rank's weight publisher for `trainer` (collective: every rank makes one), rank 0's with its engines."""
    from mpo.weight_sync.publisher import Publisher

    weights = Publisher(trainer.config, trainer.model_cfg, trainer.gpt,
                        stage=trainer.ps.get_pipeline_model_parallel_rank(), device=trainer.ctx.device.device,
                        object_group=trainer.ctx.object_group, engines=engines,
                        score_probes=functools.partial(_trainer_probe_logprobs, trainer))
    distribute = trainer.distributor()  # collective when new, as this is
    distribute.on_republish = lambda: weights.publish(weights.version)
    # sync mode: a collect whose engines were all restarted (stale) has every rank publish again (off-policy, rank 0's
    # producer thread must not start a collective)
    if trainer.config.schedule.mode == "sync":
        trainer.collector.republish = distribute.republish
    return weights


def supervised_warm_start(trainer: Trainer) -> float:
    """A few teacher-forced steps on task answers, so RL starts from a policy that sometimes succeeds."""
    from mpo.trainer.rows import Sample

    cfg = trainer.config
    for group in trainer.optimizer.param_groups:
        group["lr"] = cfg.schedule.sft_lr
    loss_value = float("nan")
    for step in range(cfg.schedule.sft_steps):
        pairs = trainer.task.warm_start_prompts(step, 64) if trainer.rank == 0 else None
        pairs = _broadcast_object(pairs, group=trainer.ctx.object_group)  # rank 0 reads the data
        samples = [Sample(ids=[*ids, *answer], prompt_len=len(ids), group=0, reward=0.0) for ids, answer in pairs]
        mbs = trainer.pass_microbatches([samples])[0]
        total = float(sum(len(answer) for _, answer in pairs))

        def loss_fn(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
            loss = -(logprobs * mb.extras["mask"]).sum() / total
            return loss, {"sft_loss": loss.detach()}

        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        outs = run_microbatches(trainer.model, mbs, vocab_size=trainer.model_cfg.vocab_size, loss_fn=loss_fn)
        trainer.optimizer.step()
        if outs:  # this rank's share of the global loss (each share divides by every rank's tokens)
            loss_value = sum(float(o["sft_loss"]) for o in outs)
    if cfg.schedule.sft_steps and trainer.is_last_stage:  # the last step's loss: the shares summed over DP
        total = torch.tensor([loss_value], dtype=torch.float64)
        loss_value = all_reduce_(total, group=trainer.dp_group).item()
    for group in trainer.optimizer.param_groups:
        group["lr"] = cfg.schedule.lr
    return loss_value


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


def run(config: TrainConfig) -> None:
    """Train to config.schedule.steps on every rank (under torchrun); resumes from the newest checkpoint."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(levelname)s %(message)s")
    for noisy in ("httpx", "megatron"):  # one line per engine call / per parameter is noise at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    out_dir = Path(config.logging.out_dir)
    # Rank 0 launches its local engines first: they start while the ranks build their models (~3.5 s each on CPU,
    # paid by every run and most tests), and are waited for once the trainer is up.
    engines = EngineSet(config, out_dir, model_config(config), wait=False) if launch_rank() == 0 else None
    trainer: Trainer | None = None
    metrics_log = None
    evaluator: Evaluator | None = None
    schedule: RolloutSchedule | None = None
    producer: ProducerProcess | None = None
    weights = None
    try:
        trainer = Trainer(config)
        start = trainer.resume()
        if engines is not None:
            engines.wait_ready()
            trainer.collector.connect(engines.handles)
            if config.schedule.mode != "sync":  # started now: its imports overlap the warm start and first push
                producer = ProducerProcess(trainer.config, engines.handles, clock=trainer.clock,
                                           context_length=trainer.model_cfg.max_position_embeddings)
        weights = publisher(trainer, engines)
        if start == 0 and config.schedule.sft_steps:
            sft_loss = supervised_warm_start(trainer)
            if trainer.rank == 0:
                log.info("supervised warm start: %d steps, final loss %.4f", config.schedule.sft_steps, sft_loss)
        weights.publish(version=start)
        if trainer.rank == 0:
            metrics_log = MetricsLog(out_dir, tensorboard=config.logging.tensorboard, total_steps=config.schedule.steps,
                                     progress=config.logging.progress, start_step=start, wandb=wandb_settings(config),
                                     versions_per_token=config.logging.versions_per_token)
            metrics_log.truncate_after(start - 1)
            # Rank 0's rollout source: inline (sync) or a producer thread ahead of the trainer (one_step_off, async)
            # that waits on the producer process, which collects off this process's GIL (mpo.trainer.producer)
            collect = trainer.collector.collect
            if producer is not None:  # it continues from rank 0's rollout state (resumed, after the warm start)
                producer.load_state_dict(trainer.collector.state_dict())
                trainer.task.close()  # rank 0's reward workers would idle: the producer's score from now on
                trainer.producer, collect = producer, producer.collect
            schedule = RolloutSchedule(collect, config.schedule.mode, config.schedule.max_staleness,
                                       start=start, steps=config.schedule.steps, on_versions=metrics_log.log_versions,
                                       memory=_memory_hook(engines) if config.rollout.colocate else None)
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
                    metrics_log.log_samples((producer or trainer.collector).samples_log)
            trainer.stop_if_nonfinite(step + 1)
            every = config.logging.checkpoint_every
            if (every and (step + 1) % every == 0) or step + 1 == config.schedule.steps:
                with trainer.clock("checkpoint"):
                    trainer.save(step + 1)
        # The final policy: its own row, step = schedule.steps, eval metrics only (again on a rerun of a finished run,
        # whose resume dropped it with every row past the checkpoint).
        final = _evaluate(evaluator, config.schedule.steps, metrics_log)
        if final:
            metrics_log.log(config.schedule.steps, final, progress=False)
    finally:
        if schedule is not None:  # first: a producer mid-batch is aborted before its engines stop
            schedule.stop(abort=lambda: [producer and producer.close()] + [c.abort_all() for c in engines.clients])
        try:
            if metrics_log is not None:
                metrics_log.close()
        finally:  # the engines stop even when closing the log fails (a full disk, say)
            if producer is not None:  # its reward workers with it
                producer.close()
            if trainer is not None:
                trainer.task.close()
            if evaluator is not None:
                evaluator.close()
            if weights is not None:
                weights.close()
            if engines is not None:
                engines.stop()
    dist.barrier()
