"""The run: set-up, optional supervised warm start, RL steps with weight sync, metrics, checkpoints, resume."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mpo.config import TrainConfig
from mpo.config_checks import model_config
from mpo.lifecycle import freeze_startup_heap
from mpo.models.forward import MicroBatch, run_microbatches
from mpo.parallel.collectives import all_reduce_
from mpo.parallel.init import launch_rank
from mpo.rollout.engines import EngineSet
from mpo.trainer.evaluation import Evaluator, due
from mpo.trainer.metrics_log import MetricsLog, print_interval, run_summary, wandb_settings
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
    from mpo.models.context_parallel import padded_width

    scored: list[list[float] | None] = [None] * len(probes)
    with torch.no_grad():
        for length, rows in by_length.items():
            # trailing tokens up to a length context parallelism can split (causal: the probe's scores unchanged)
            width = padded_width(length)
            batch = MicroBatch(torch.tensor([probes[j] + [0] * (width - length) for j in rows], device=trainer.device))
            outs = run_microbatches(trainer.model, [batch],
                                    vocab_size=trainer.model_cfg.vocab_size, forward_only=True)
            for row, j in enumerate(rows if outs else []):
                scored[j] = outs[0]["logprobs"][row, :length].tolist()
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


def _sft_loss(trainer: Trainer, share: float) -> float:
    """Collective: a warm-start step's loss on every rank, from this rank's share (the last stage's shares summed over
    data parallelism; the last global rank is on the last stage)."""
    if trainer.is_last_stage:
        share = all_reduce_(torch.tensor([share], dtype=torch.float64), group=trainer.dp_group).item()
    return _broadcast_object(share, src=dist.get_world_size() - 1, group=trainer.ctx.object_group)


def supervised_warm_start(trainer: Trainer, every: int = 0) -> float:
    """Teacher-forced steps on task answers, so RL starts from a policy that sometimes succeeds: from
    trainer.sft_steps_done (0, or a resumed checkpoint's) to schedule.sft_steps; rank 0 logs the loss every `every`
    steps (and the first and last). Returns the last step's loss."""
    from mpo.trainer.rows import Sample

    cfg = trainer.config
    steps = cfg.schedule.sft_steps
    for group in trainer.optimizer.param_groups:
        group["lr"] = cfg.schedule.sft_lr
    loss_value = float("nan")
    started, first = time.perf_counter(), trainer.sft_steps_done
    for step in range(first, steps):
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
        trainer.sft_steps_done = step + 1
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
    began = time.perf_counter()
    every = print_interval(config.logging)
    first_rank = launch_rank() == 0
    # Start-up takes a while (engines, models, a checkpoint to load): rank 0 says what it is doing, in a few lines.
    if first_rank and not config.rollout.urls:
        log.info("starting %d local engine%s (logs: %s)", config.rollout.num_engines,
                 "s" * (config.rollout.num_engines > 1), out_dir / "logs")
    # Rank 0 launches its local engines first: they start while the ranks build their models (~3.5 s each on CPU,
    # paid by every run and most tests), and are waited for once the trainer is up.
    engines = EngineSet(config, out_dir, model_config(config), wait=False) if first_rank else None
    trainer: Trainer | None = None
    metrics_log = None
    evaluator: Evaluator | None = None
    schedule: RolloutSchedule | None = None
    producer: ProducerProcess | None = None
    weights = None
    try:
        if first_rank:
            log.info("building the model on %d rank%s", config.world_size, "s" * (config.world_size > 1))
        trainer = Trainer(config)
        start = trainer.resume()
        if engines is not None:
            waited = time.perf_counter()
            engines.wait_ready()
            if trainer.rank == 0:
                log.info("%d engine%s ready, %.0f s after start (%.1f s waited for once the model was built)",
                         len(engines.handles), "s" * (len(engines.handles) > 1), time.perf_counter() - began,
                         time.perf_counter() - waited)
            trainer.collector.connect(engines.handles)
            if config.schedule.mode != "sync":  # started now: its imports overlap the warm start and first push
                producer = ProducerProcess(trainer.config, engines.handles, clock=trainer.clock,
                                           context_length=trainer.model_cfg.max_position_embeddings)
        weights = publisher(trainer, engines)
        if start == 0 and trainer.sft_steps_done < config.schedule.sft_steps:
            if trainer.rank == 0:
                log.info("supervised warm start: %d steps%s", config.schedule.sft_steps,
                         f", from step {trainer.sft_steps_done}" if trainer.sft_steps_done else "")
            supervised_warm_start(trainer, every or 10)  # its last step's loss is logged
            # A crash in RL's first steps does not repeat the warm start: its checkpoint, committed before RL begins
            if config.logging.checkpoint_every:
                trainer.save(0, wait=True)
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
            collect = trainer.collector.collect
            if producer is not None:  # it continues from rank 0's rollout state (resumed, after the warm start)
                producer.load_state_dict(trainer.collector.state_dict())
                trainer.task.close()  # rank 0's reward workers would idle: the producer's score from now on
                trainer.producer, collect = producer, producer.collect
            schedule = RolloutSchedule(collect, config.schedule.mode, config.schedule.max_staleness,
                                       start=start, steps=config.schedule.steps, on_versions=metrics_log.log_versions,
                                       memory=_memory_hook(engines) if config.rollout.colocate else None,
                                       rows=lambda: (producer or trainer.collector).samples_log)
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
