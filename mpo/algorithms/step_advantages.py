"""The trainer's one entry to every advantage estimator: per-response (group) estimators, per-token ones and the
running-mean baseline, computed on the whole step's batch (so whitening is over the global batch) from rewards,
prompt groups and completion lengths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .advantage_registry import ADVANTAGE_REGISTRY, AdvantageSpec, find_advantage
from .advantages import compute_advantages, group_stats
from .token_advantages import EMABaseline, compute_token_advantages


@dataclass(frozen=True)
class AdvantageConfig:
    """An estimator name and its parameters, validated on construction."""

    name: str = "grpo"
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if find_advantage(self.name) is None:
            valid = ADVANTAGE_REGISTRY.names(sort=False)
            raise ValueError(f"advantage={self.name!r}; valid values: {', '.join(valid)}")
        unknown = sorted(set(self.args) - set(self.spec.args))
        if unknown:
            raise ValueError(f"advantage_args {unknown} are not parameters of {self.name!r}; valid: "
                             f"{list(self.spec.args)}")
        for key, value in self.args.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"advantage_args.{key}={value!r} must be a number")
        if "gamma" in self.args and not 0 < self.args["gamma"] <= 1:
            raise ValueError(f"advantage_args.gamma={self.args['gamma']} must be in (0, 1]")
        for key in ("lam", "lam_value"):
            if key in self.args and not 0 <= self.args[key] <= 1:
                raise ValueError(f"advantage_args.{key}={self.args[key]} must be in [0, 1]")
        if "alpha" in self.args and not self.args["alpha"] > 0:
            raise ValueError(f"advantage_args.alpha={self.args['alpha']} must be > 0")
        if "eps" in self.args and self.args["eps"] < 0:
            raise ValueError(f"advantage_args.eps={self.args['eps']} must be >= 0")
        if "beta" in self.args:
            EMABaseline(self.args["beta"])  # validates the range

    @property
    def spec(self) -> AdvantageSpec:
        return ADVANTAGE_REGISTRY.get(self.name)

    @property
    def needs_critic(self) -> bool:
        """GAE / VAPO: advantages come from the critic's values, after the old forward (mpo.trainer.critic)."""
        return self.spec.needs_critic


class StepAdvantages:
    """Advantages of one RL step's responses; holds the running baseline of ``reinforce_ema`` (trainer state)."""

    def __init__(self, config: AdvantageConfig) -> None:
        self.config = config
        self.ema = config.spec.fn(**config.args) if config.spec.level == "running" else None

    @classmethod
    def for_algorithm(cls, algorithm) -> "StepAdvantages":
        """The estimator a config's `algorithm` section names (advantage, advantage_args): the trainer's and the
        rollout producer process's are made alike."""
        return cls(AdvantageConfig(algorithm.advantage, dict(algorithm.advantage_args)))

    def __call__(self, rewards: Tensor, group_ids: Tensor, lengths: list[int],
                 loss_masks: list | None = None) -> tuple[list[list[float]], Tensor]:
        """Per response, the advantage of each completion token, and ``zero_variance [N]`` (its group's rewards
        are all equal: no learning signal for group baselines). ``loss_masks``: per response, 1 at the tokens that
        carry loss (None: all of them); multi-turn observation tokens are 0, so per-token estimators skip them (the
        next generated token is a token's successor) and whiten over generated tokens only."""
        name, args = self.config.name, self.config.args
        rewards = rewards.to(torch.float64)
        zero_variance = group_stats(rewards, group_ids).std == 0
        if self.config.needs_critic:  # filled in per rank once the critic has scored the rows
            return [[0.0] * n for n in lengths], zero_variance
        if self.config.spec.level == "response":
            scalar = compute_advantages(rewards, group_ids, estimator=name, **args).advantages
        elif self.ema is not None:
            scalar, _ = self.ema(rewards)
        else:
            mask = torch.zeros(len(lengths), max(lengths, default=0) or 1, dtype=torch.float64)
            for i, n in enumerate(lengths):
                given = loss_masks[i] if loss_masks is not None else None
                mask[i, :n] = 1.0 if given is None else torch.tensor(given, dtype=torch.float64)
            per_token = compute_token_advantages(name, rewards, mask, group_ids=group_ids, **args).advantages
            return [per_token[i, :n].tolist() for i, n in enumerate(lengths)], zero_variance
        return [[float(a)] * n for a, n in zip(scalar, lengths)], zero_variance

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema.state_dict()} if self.ema is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
