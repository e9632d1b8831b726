"""The one reward registry: name -> function, plus `module:attr` / `path/to/file.py:attr` plug-ins (mpo.registry)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpo.registry import Registry

RewardFn = Callable[[str, Any, dict], float]


def _adapt_reward(name: str, obj: Any) -> RewardFn:
    if not callable(obj):
        raise ValueError(f"reward {name!r}: {name.rpartition(':')[2]!r} is a {type(obj).__name__}, not a function")
    return obj


REWARD_REGISTRY: Registry[RewardFn] = Registry("reward", adapt=_adapt_reward, builtins=("mpo.rewards.builtin",))
# Called once in each pool worker before it takes work, so slow imports (sympy: ~2 s) do not eat the first
# completions' timeout. A plug-in module does its slow imports at module level instead (imported before work too).
REWARD_WARMUPS: dict[str, Callable[[], None]] = {}


def register_reward(name: str, *, warmup: Callable[[], None] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(completion, answer, metadata) -> float`` under ``name`` (and its `warmup`)."""

    def decorator(fn: RewardFn) -> RewardFn:
        REWARD_REGISTRY.register(name, fn)
        if warmup is not None:
            REWARD_WARMUPS[name] = warmup
        return fn

    return decorator


def reward_names() -> list[str]:
    return REWARD_REGISTRY.names()


def get_reward(name: str) -> RewardFn:
    """The reward function named `name`: a registered name, or a plug-in `module:attr` / `path/to/file.py:attr`."""
    return REWARD_REGISTRY.get(name)


def warm_up(name: str) -> None:
    """Run the registered warm-up of reward `name`, if any (plug-ins have none)."""
    if name in REWARD_REGISTRY and name in REWARD_WARMUPS:  # `in` loads the built-ins, registering their warm-ups
        REWARD_WARMUPS[name]()
