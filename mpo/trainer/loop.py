"""The run: set-up, optional supervised warm start, RL steps with weight sync, metrics, checkpoints, resume."""

from __future__ import annotations

import contextlib
import functools
import logging
import subprocess
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from mpo.config import TrainConfig, model_config
from mpo.models.forward import MicroBatch, run_microbatches
from mpo.trainer.evaluation import Evaluator, due
from mpo.trainer.metrics_log import MetricsLog, wandb_settings
from mpo.trainer.schedule import RolloutSchedule
from mpo.trainer.trainer import Trainer, _broadcast_object

log = logging.getLogger(__name__)
# The CPU priority (nice) of local engines in the off-policy modes (see EngineSet.local_processes).
LOCAL_ENGINE_NICE = 10


class EngineSet:
    """Rank 0's engines: connects to configured URLs, or starts local mpo engines (and restarts them if they die)."""

    def __init__(self, config: TrainConfig, out_dir: Path) -> None:
        from mpo.rollout.client import EngineClient
        from mpo.rollout.local_engine import LocalEngineProcess

        r = config.rollout
        model = model_config(config)
        self.processes: list[LocalEngineProcess] = []
        self.engine, self.transport = r.engine, r.sync
        # The distributed weight-update group: one rank per engine TP rank, rendezvous at trainer rank 0.
        self.tp_size = r.tensor_parallel if r.engine == "sglang" else 1
        self.sync_master_address = r.sync_master_address or "127.0.0.1"
        self._sync = None
        # The weights last pushed, so an engine restarted mid-rollout serves the current policy, not its init.
        # Kept only for local (CPU-sized) engines; external engines are restarted by whoever runs them.
        self.last_weights: tuple[list, str] | None = None
        # Restarts (the rollout pool's, on its thread) and weight updates (the trainer's) one at a time: in async mode
        # the producer restarts a killed engine while the trainer syncs, whose pause then hit a dead engine.
        self._engine_lock = threading.RLock()
        if r.urls:
            self.handles = [(EngineClient(url, api_key=r.api_key, timeout_s=r.request_timeout_s,
                                          num_layers=model.num_layers, topk=model.router_topk,
                                          num_experts=model.num_experts), None)
                            for url in r.urls]
            return
        if r.engine != "mpo":
            raise ValueError("rollout.urls is empty: only rollout.engine='mpo' can be started locally; SGLang servers "
                             "are started by the launcher (launch/) and passed as rollout.urls")
        for process in self.local_processes(config, out_dir):
            self.processes.append(process.start())
        self.handles = [(p.client, functools.partial(self._restart, p)) for p in self.processes]

    @staticmethod
    def local_processes(config: TrainConfig, out_dir: Path) -> list:
        """The `rollout.num_engines` local mpo engines of `config`, not started yet. Their command comes from the
        same builder as the launcher's (mpo.rollout.engine_command), so both start the same engine."""
        from mpo.rollout.engine_command import EngineSettings
        from mpo.rollout.local_engine import LocalEngineProcess

        model = model_config(config)
        settings = EngineSettings.from_config(config)
        # Off-policy, a local engine generates while the ranks train on the same cores: at a lower priority it takes
        # the cycles the ranks leave idle instead of slowing them (EP/TP ranks wait for their slowest peer).
        nice = LOCAL_ENGINE_NICE if config.schedule.mode != "sync" else 0
        return [LocalEngineProcess.mpo_engine(log_path=out_dir / "logs" / f"engine{i}.log", settings=settings,
                                              num_layers=model.num_layers, topk=model.router_topk, nice=nice)
                for i in range(config.rollout.num_engines)]

    def _restart(self, process) -> None:
        """Restart a local engine and give it the weights last pushed. Waits for a weight update in flight (which then
        leaves last_weights at its version); an engine that another thread brought back meanwhile is left alone."""
        from mpo.weight_sync.transports import WeightSync

        with self._engine_lock:
            if process.process is not None and process.process.poll() is None and process.client.healthy(2.0):
                return  # restarted (or found healthy) while this caller waited for the lock
            process.restart()
            if self.last_weights is not None:
                named, version = self.last_weights
                WeightSync([process.client], engine="mpo", transport="tensor").push(named, version)

    @contextlib.contextmanager
    def updating(self):
        """Rank 0, around a weight update: no engine restart runs meanwhile (one in flight finishes first); a local
        engine found down is restarted before the update, so that its pause / push reach a live engine; one that dies
        during the update is left out of it (WeightSync.expendable) and restarted after it, with its weights."""
        with self._engine_lock:
            self._restart_exited("before")
            yield
            self._restart_exited("after")

    def _restart_exited(self, when: str) -> None:
        for process in self.processes:  # exited (a busy engine may answer health checks slowly: not asked)
            if process.process is None or process.process.poll() is not None:
                log.warning("engine %s is down %s the weight update; restarting it", process.url, when)
                self._restart(process)

    def _exited(self, client) -> bool:
        """Whether `client` is a local engine whose process exited (waited for briefly: a killed engine's connections
        close just before its process is gone)."""
        for process in self.processes:
            if process.client is client and process.process is not None:
                try:
                    process.process.wait(timeout=2.0)
                    return True
                except subprocess.TimeoutExpired:
                    return False
        return False

    def remember(self, named: list, version: str) -> None:
        if self.processes:
            self.last_weights = (named, version)

    @property
    def clients(self):
        return [client for client, _ in self.handles]

    def weight_sync(self, bucket_bytes: int):
        """The set's one WeightSync (its distributed group, if any, is made once and reused every step)."""
        from mpo.weight_sync.transports import WeightSync

        if self._sync is None:
            self._sync = WeightSync(self.clients, engine=self.engine, transport=self.transport,
                                    bucket_bytes=bucket_bytes, tp_sizes=self.engine_tp_sizes(),
                                    master_address=self.sync_master_address)
            if self.transport != "distributed":  # a dead member would leave the group's collectives hanging
                self._sync.expendable = self._exited
        return self._sync

    def engine_tp_sizes(self) -> list[int]:
        """Weight-update ranks of each engine: its own `tp_size` from /server_info (SGLang's --tp; mpo's engine
        reports 1), else the configured rollout.tensor_parallel (an engine that cannot be asked now). A configured
        size that the engine contradicts is logged and the engine's is used: a wrong group size hangs the sync."""
        sizes = []
        for client in self.clients:
            try:
                reported = client.call("/server_info", method="GET", timeout_s=10).get("tp_size")
            except Exception:  # noqa: BLE001 - unreachable now (e.g. not started yet): the configured size
                reported = None
            if isinstance(reported, int) and reported >= 1:
                if reported != self.tp_size:
                    log.warning("engine %s reports tp_size=%d; rollout.tensor_parallel says %d: using %d",
                                client.url, reported, self.tp_size, reported)
                sizes.append(reported)
            else:
                sizes.append(self.tp_size)
        return sizes

    def stop(self) -> None:
        if self._sync is not None:
            try:
                self._sync.close()
            except Exception as exc:  # noqa: BLE001 - engines may already be gone; stopping must go on
                log.warning("closing the weight-update group failed: %s", exc)
        for process in self.processes:
            process.stop()


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

    return Publisher(trainer.config, trainer.model_cfg, trainer.gpt,
                     stage=trainer.ps.get_pipeline_model_parallel_rank(), device=trainer.ctx.device.device,
                     object_group=trainer.ctx.object_group, engines=engines,
                     score_probes=functools.partial(_trainer_probe_logprobs, trainer))


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
        if outs:
            loss_value = sum(float(o["sft_loss"]) for o in outs)
    for group in trainer.optimizer.param_groups:
        group["lr"] = cfg.schedule.lr
    return loss_value


def _memory_hook(engines: EngineSet):
    """Colocated engines: release / resume every engine's memory (SGLang's memory-saver endpoints)."""

    def memory(action: str, tags: list[str] | None) -> None:
        for client in engines.clients:
            getattr(client, f"{action}_memory_occupation")(tags)

    return memory


def _evaluate(evaluator: Evaluator | None, step: int, engines: EngineSet | None,
              metrics_log: MetricsLog | None) -> dict[str, float]:
    """Rank 0, when `eval` says the policy about to train `step` is evaluated: held-out metrics (eval.jsonl too)."""
    if evaluator is None or not due(evaluator.config, step):
        return {}
    metrics, rows = evaluator.run(step, engines.handles)
    metrics_log.log_eval(rows)
    log.info("evaluation before step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    return metrics


def run(config: TrainConfig) -> None:
    """Train to config.schedule.steps on every rank (under torchrun); resumes from the newest checkpoint."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(levelname)s %(message)s")
    for noisy in ("httpx", "megatron"):  # one line per engine call / per parameter is noise at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    out_dir = Path(config.logging.out_dir)
    trainer = Trainer(config)
    start = trainer.resume()
    engines = None
    metrics_log = None
    evaluator: Evaluator | None = None
    schedule: RolloutSchedule | None = None
    weights = None
    try:
        if trainer.rank == 0:
            engines = EngineSet(config, out_dir)
            trainer.collector.connect(engines.handles)
        weights = publisher(trainer, engines)
        if start == 0 and config.schedule.sft_steps:
            sft_loss = supervised_warm_start(trainer)
            if trainer.rank == 0:
                log.info("supervised warm start: %d steps, final loss %.4f", config.schedule.sft_steps, sft_loss)
        weights.publish(version=f"step{start}")
        if trainer.rank == 0:
            metrics_log = MetricsLog(out_dir, tensorboard=config.logging.tensorboard, total_steps=config.schedule.steps,
                                     progress=config.logging.progress, start_step=start, wandb=wandb_settings(config),
                                     versions_per_token=config.logging.versions_per_token)
            metrics_log.truncate_after(start - 1)
            # Rank 0's rollout source: inline (sync) or a producer thread ahead of the trainer (one_step_off, async)
            schedule = RolloutSchedule(trainer.collector.collect, config.schedule.mode, config.schedule.max_staleness,
                                       start=start, steps=config.schedule.steps, on_versions=metrics_log.log_versions,
                                       memory=_memory_hook(engines) if config.rollout.colocate else None)
        if trainer.rank == 0 and config.eval.every:
            evaluator = Evaluator(config)
        for step in range(start, config.schedule.steps):
            with trainer.clock("eval"):
                held_out = _evaluate(evaluator, step, engines, metrics_log)  # the policy the engines hold: `step`
            metrics = trainer.train_step(step, schedule.take if schedule is not None else None)
            metrics.update(held_out)
            if schedule is not None:
                schedule.before_sync()
            try:
                with trainer.clock("sync"):
                    metrics.update(weights.publish(version=f"step{step + 1}"))
            finally:
                if schedule is not None:
                    schedule.after_sync(step + 1)
            if schedule is not None:
                metrics.update(schedule.step_metrics())
            metrics.update(trainer.clock.take())  # rank 0's phases (time/<phase>_s with logging.phase_times)
            if metrics_log is not None:
                with trainer.clock("metrics_write"):
                    metrics_log.log(step, metrics)
                    metrics_log.log_samples(trainer.collector.samples_log)
            trainer.stop_if_nonfinite(step + 1)
            every = config.logging.checkpoint_every
            if (every and (step + 1) % every == 0) or step + 1 == config.schedule.steps:
                with trainer.clock("checkpoint"):
                    trainer.save(step + 1)
        # The final policy: its own row, step = schedule.steps, eval metrics only (again on a rerun of a finished run,
        # whose resume dropped it with every row past the checkpoint).
        final = _evaluate(evaluator, config.schedule.steps, engines, metrics_log)
        if final:
            metrics_log.log(config.schedule.steps, final, progress=False)
    finally:
        if schedule is not None:  # first: a producer mid-batch is aborted before its engines stop
            schedule.stop(abort=lambda: [client.abort_all() for client in engines.clients])
        try:
            if metrics_log is not None:
                metrics_log.close()
        finally:  # the engines stop even when closing the log fails (a full disk, say)
            trainer.task.close()
            if evaluator is not None:
                evaluator.close()
            if weights is not None:
                weights.close()
            if engines is not None:
                engines.stop()
    dist.barrier()
