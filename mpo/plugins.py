"""`module:attr` plug-ins (reward functions, environment classes): one resolver, one set of one-line errors."""

from __future__ import annotations

import importlib


def resolve_plugin(kind: str, name: str, target: str) -> object:
    """The object `target` ("module:attr", attr may be dotted) names; ValueError naming the `kind` and the user's
    `name` when the module does not import or lacks the attribute."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{kind} {name!r}: cannot import module {module_name!r}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
