"""The one environment registry: name -> class, built-ins named lazily by `module:Class`, plus `module:Class` /
`path/to/file.py:Class` plug-ins (mpo.registry)."""

from __future__ import annotations

from typing import Any

from mpo.registry import Registry


def _adapt_env(name: str, cls: Any) -> type:
    """The class check: a class with callable reset() and step()."""
    attr = name.rpartition(":")[2]
    if not isinstance(cls, type):
        raise ValueError(f"environment {name!r}: {attr!r} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {name!r}: class {attr!r} has no {' or '.join(missing)}() method")
    return cls


ENV_REGISTRY: Registry[type] = Registry("environment", adapt=_adapt_env)
ENV_REGISTRY.register_lazy("calculator", "mpo.envs.calculator:CalculatorEnv")


def get_env_class(name: str) -> type:
    """The environment class named `name` (registered, or a plug-in); ValueError (one line) if it cannot be imported
    or lacks reset() / step()."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"environment {name!r}: expected a registered name ({', '.join(ENV_REGISTRY.names())}) or "
                         "'module:Class'")
    return ENV_REGISTRY.get(name)
