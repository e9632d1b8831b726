"""The one environment registry: name -> "module:Class", plus `module:Class` plug-ins resolved by import."""

from __future__ import annotations

from mpo.plugins import resolve_plugin

# Built-in environments, imported lazily by name.
ENV_REGISTRY: dict[str, str] = {
    "calculator": "mpo.envs.calculator:CalculatorEnv",
}


def get_env_class(name: str) -> type:
    """The environment class named `name` (registered, or ``module:Class``); ValueError (one line) if it cannot be
    imported or lacks reset() / step()."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"environment {name!r}: expected a registered name ({', '.join(sorted(ENV_REGISTRY))}) or "
                         "'module:Class'")
    target = ENV_REGISTRY.get(name, name)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"unknown environment {name!r}; known environments: {', '.join(sorted(ENV_REGISTRY))}, "
                         "or 'module:Class'")
    cls = resolve_plugin("environment", name, target)
    if not isinstance(cls, type):
        raise ValueError(f"environment {name!r}: {attr!r} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {name!r}: class {attr!r} has no {' or '.join(missing)}() method")
    return cls
