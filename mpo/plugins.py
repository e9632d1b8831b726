"""Plug-ins (reward functions, environment classes): one resolver, one set of one-line errors.

A plug-in is named `module:attr` (imported by name; the current directory is tried too, as `python script.py` users
expect, without needing PYTHONPATH) or `path/to/file.py:attr` (the file loaded as a module of its own; a relative
path is read from the current directory, which the trainer's ranks and the reward workers share with `mpo`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def _load_file(kind: str, name: str, path_text: str) -> ModuleType:
    path = Path(path_text).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_file():
        raise ValueError(f"{kind} {name!r}: no Python file {str(path)!r}")
    # One module per file (its resolved path hashed into the name): loading the same file again, from the config's
    # check and then from a worker, gives the same module, and two files called reward.py do not collide.
    resolved = path.resolve()
    module_name = f"mpo_plugin_{resolved.stem}_{hashlib.blake2b(str(resolved).encode(), digest_size=6).hexdigest()}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"{kind} {name!r}: {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ValueError(f"{kind} {name!r}: {str(path)!r} failed to load: {type(e).__name__}: {e}") from None
    return module


def _import_module(kind: str, name: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        top, cwd = module_name.split(".")[0], os.getcwd()
        beside = os.path.exists(os.path.join(cwd, top)) or os.path.exists(os.path.join(cwd, top + ".py"))
        # Only the plug-in's own module, found in the current directory, is retried from there: an import that
        # fails inside the plug-in is the plug-in's error and is reported as it is.
        if isinstance(e, ModuleNotFoundError) and e.name == top and beside and cwd not in sys.path:
            sys.path.append(cwd)
            return _import_module(kind, name, module_name)
        raise ValueError(f"{kind} {name!r}: cannot import module {module_name!r}: {e}") from None


def resolve_plugin(kind: str, name: str, target: str) -> object:
    """The object `target` ("module:attr" or "path/to/file.py:attr", attr may be dotted) names; ValueError naming
    the `kind` and the user's `name` when the module or file does not load or lacks the attribute."""
    module_part, _, attr = target.rpartition(":")
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:  # a Python file, not a module
        module = _load_file(kind, name, module_part)
    else:
        module = _import_module(kind, name, module_part)
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {name!r}: module {module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
