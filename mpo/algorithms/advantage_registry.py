"""The one advantage-estimator registry, as `register_loss` is for losses.

An estimator registers where it is defined (`mpo.algorithms.advantages`, `mpo.algorithms.token_advantages`) with
how it is computed (`level`), the parameters it takes from `algorithm.advantage_args`, and what it needs: prompt
groups of two or more responses (`needs_groups`: its baseline is the group's), the critic's values
(`needs_critic`). Config validation, the trainer (`StepAdvantages`) and the memory plan ask this registry; nothing
here imports back.

Levels:
    response: ``fn(rewards [N], GroupStats, eps, verl_singletons) -> [N]``, one advantage per response.
    token:    ``fn(rewards [B], mask [B, T], **kwargs) -> TokenAdvantages``, per response token.
    running:  ``fn(**args)`` builds a stateful baseline (``__call__(rewards) -> (advantages, baseline)``, with
              ``state_dict``), kept in checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Level = Literal["response", "token", "running"]


@dataclass(frozen=True)
class AdvantageSpec:
    name: str
    level: Level
    fn: Callable[..., Any]
    args: tuple[str, ...] = ()
    needs_groups: bool = False
    needs_critic: bool = False


ADVANTAGE_REGISTRY: dict[str, AdvantageSpec] = {}


def register_advantage(name: str, *, level: Level, args: tuple[str, ...] = (), needs_groups: bool = False,
                       needs_critic: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as the estimator ``name``."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in ADVANTAGE_REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_REGISTRY[name] = AdvantageSpec(name, level, fn, tuple(args), needs_groups, needs_critic)
        return fn

    return decorator


def get_advantage(name: str, level: Level | None = None) -> AdvantageSpec:
    """The estimator ``name`` (of ``level``, when given); a ValueError lists the valid names."""
    spec = ADVANTAGE_REGISTRY.get(name)
    if spec is None or (level is not None and spec.level != level):
        valid = [n for n, s in ADVANTAGE_REGISTRY.items() if level is None or s.level == level]
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(valid)}")
    return spec
