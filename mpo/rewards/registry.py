"""The one reward registry: name -> function, plus ``module:function`` plug-ins resolved by import."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpo.plugins import resolve_plugin

RewardFn = Callable[[str, Any, dict], float]

REWARD_REGISTRY: dict[str, RewardFn] = {}
# Called once in each pool worker before it takes work, so slow imports (sympy: ~2 s) do not eat the first
# completions' timeout. A plug-in module does its slow imports at module level instead (imported before work too).
REWARD_WARMUPS: dict[str, Callable[[], None]] = {}


def register_reward(name: str, *, warmup: Callable[[], None] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(completion, answer, metadata) -> float`` under ``name`` (and its `warmup`)."""
    if ":" in name:
        raise ValueError(f"reward name {name!r} must not contain ':' (that form names a module:function plug-in)")

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARD_REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        REWARD_REGISTRY[name] = fn
        if warmup is not None:
            REWARD_WARMUPS[name] = warmup
        return fn

    return decorator


def _ensure_rewards_loaded() -> None:
    # The built-ins register themselves on import; importing here keeps registry.py free of import cycles.
    from . import builtin  # noqa: F401


def reward_names() -> list[str]:
    _ensure_rewards_loaded()
    return sorted(REWARD_REGISTRY)


def _load_plugin(name: str) -> RewardFn:
    if not all(name.partition(":")[::2]):
        raise ValueError(f"reward {name!r}: a plug-in is named 'module:function'")
    fn = resolve_plugin("reward", name, name)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {name.partition(':')[2]!r} is a {type(fn).__name__}, not a function")
    return fn


def get_reward(name: str) -> RewardFn:
    """The reward function named `name`: a registered name, or ``module:function`` imported by name."""
    if ":" in name:
        return _load_plugin(name)
    _ensure_rewards_loaded()
    try:
        return REWARD_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(REWARD_REGISTRY))}, "
                         "or 'module:function'") from None


def warm_up(name: str) -> None:
    """Run the registered warm-up of reward `name`, if any (plug-ins have none)."""
    if ":" not in name:
        _ensure_rewards_loaded()
        hook = REWARD_WARMUPS.get(name)
        if hook is not None:
            hook()
