"""The one advantage-estimator registry, as `register_loss` is for losses.

An estimator registers where it is defined (`mpo.algorithms.advantages`, `mpo.algorithms.token_advantages`) with how it
is computed (`level`), the parameters it takes from `algorithm.advantage_args`, and what it needs: prompt groups of two
or more responses (`needs_groups`: its baseline is the group's), the critic's values (`needs_critic`). Config
validation, the trainer (`StepAdvantages`) and the memory plan ask this registry; nothing here imports back.

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

from mpo.registry import Registry

Level = Literal["response", "token", "running"]


@dataclass(frozen=True)
class AdvantageSpec:
    name: str
    level: Level
    fn: Callable[..., Any]
    args: tuple[str, ...] = ()
    needs_groups: bool = False
    needs_critic: bool = False


def _adapt_advantage(name: str, obj: Any) -> AdvantageSpec:
    """A plug-in estimator: an AdvantageSpec (kept under the user's name), or a function carrying `level` (default
    "response"), `args`, `needs_groups` and `needs_critic` attributes, computed like the built-ins of its level."""
    if isinstance(obj, AdvantageSpec):
        return AdvantageSpec(name, obj.level, obj.fn, obj.args, obj.needs_groups, obj.needs_critic)
    if not callable(obj):
        raise ValueError(f"advantage estimator {name!r}: {name.rpartition(':')[2]!r} is a {type(obj).__name__}, not "
                         "a function")
    level = getattr(obj, "level", "response")
    if level not in ("response", "token", "running"):
        raise ValueError(f"advantage estimator {name!r}: level={level!r}; valid: response, token, running")
    return AdvantageSpec(name, level, obj, tuple(getattr(obj, "args", ())), bool(getattr(obj, "needs_groups", False)),
                         bool(getattr(obj, "needs_critic", False)))


ADVANTAGE_REGISTRY: Registry[AdvantageSpec] = Registry(
    "advantage estimator", adapt=_adapt_advantage,
    builtins=("mpo.algorithms.advantages", "mpo.algorithms.token_advantages"))


def register_advantage(name: str, *, level: Level, args: tuple[str, ...] = (), needs_groups: bool = False,
                       needs_critic: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as the estimator ``name``."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        ADVANTAGE_REGISTRY.register(name, AdvantageSpec(name, level, fn, tuple(args), needs_groups, needs_critic))
        return fn

    return decorator


def find_advantage(name: str) -> AdvantageSpec | None:
    """The estimator `name`, a plug-in ("module:attr" / "path/to/file.py:attr", mpo.plugins) loaded once; None for a
    plain name that is not registered. A plug-in that does not load raises its one-line ValueError."""
    if name in ADVANTAGE_REGISTRY or (isinstance(name, str) and ":" in name):
        return ADVANTAGE_REGISTRY.get(name)
    return None


def get_advantage(name: str, level: Level | None = None) -> AdvantageSpec:
    """The estimator ``name`` (of ``level``, when given); a ValueError lists the valid names."""
    spec = find_advantage(name)
    if spec is None or (level is not None and spec.level != level):
        valid = [n for n, s in ADVANTAGE_REGISTRY.items(sort=False) if level is None or s.level == level]
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(valid)}")
    return spec
