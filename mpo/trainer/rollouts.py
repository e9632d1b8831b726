"""The rollout side of a run, which the run loop (mpo.trainer.loop) builds beside the policy (mpo.trainer.trainer):
the task (prompts, rewards, the data position), the Collector and, off-policy, rank 0's producer process
(mpo.trainer.producer). Checkpoints keep its state through the Trainer's save / resume, handed over explicitly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from mpo.config import TrainConfig
from mpo.data.retirement import PromptRetirement
from mpo.trainer.collect import Collector
from mpo.trainer.tasks import make_task

if TYPE_CHECKING:
    from mpo.trainer.producer import ProducerProcess
    from mpo.trainer.trainer import Trainer


class Rollouts:
    """One rank's rollout side: the task and Collector on every rank (only rank 0's draw and score), rank 0's producer
    process once `hand_over` runs. `collect` / `samples_log` / `state_dict` are whichever of the two owns them now."""

    def __init__(self, config: TrainConfig, *, rank: int, clock, context_length: int, advantages) -> None:
        self.task = make_task(config, rank=rank)
        retire = config.data.retire_pass_rate
        self.collector = Collector(config, self.task, clock=clock,  # rank 0 samples, retires, keeps the set
                                   retirement=PromptRetirement(retire) if retire is not None else None,
                                   context_length=context_length, advantages=advantages)
        self.producer: ProducerProcess | None = None

    @classmethod
    def beside(cls, trainer: Trainer) -> Rollouts:
        """The rollout side for `trainer`'s config, sharing its phase clock and advantage estimator."""
        return cls(trainer.config, rank=trainer.rank, clock=trainer.clock,
                   context_length=trainer.model_cfg.max_position_embeddings, advantages=trainer.advantages)

    def set_algorithm(self, config: TrainConfig, advantages) -> None:
        """Follow Trainer.set_algorithm: the new algorithm section and advantage estimator from the next collect."""
        self.collector.set_algorithm(config, advantages)
        if self.producer is not None:  # off-policy: the producer process's own Collector
            self.producer.set_algorithm(config)

    def on_stale(self, republish: Callable[[], None]) -> None:
        """Sync mode: a collect whose engines were all restarted (stale) calls `republish` (every rank publishes
        again); off-policy, rank 0's producer thread must not start a collective, so it is not set there."""
        self.collector.republish = republish

    def hand_over(self, producer: ProducerProcess) -> None:
        """Rank 0, off-policy: `producer` continues from the rollout state as it is now (resumed, after the warm
        start) and owns it from here; this rank's reward workers would idle, so they close."""
        producer.load_state_dict(self.collector.state_dict())
        self.task.close()
        self.producer = producer

    @property
    def collect(self) -> Callable[..., tuple[list, dict[str, float]]]:
        """Rank 0's rollout source: step (, version) -> (samples, metrics)."""
        return (self.producer or self.collector).collect

    @property
    def samples_log(self) -> list[dict]:
        return (self.producer or self.collector).samples_log

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (Collector.state_dict)."""
        return (self.producer or self.collector).state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A resumed checkpoint's rollout state (Trainer.resume's; None: a fresh run, nothing to load)."""
        if state is not None:
            self.collector.load_state_dict(state)

    def close(self) -> None:
        """End the producer process (its reward workers with it), then this rank's task."""
        if self.producer is not None:
            self.producer.close()
        self.task.close()
