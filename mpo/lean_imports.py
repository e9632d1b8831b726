"""Imports that cost every process start-up time and do nothing for mpo, declined where they are made.

- megatron-core imports wandb at import time (megatron.core.timers, and its dynamic inference engine) only to write
  its own timers to a wandb run when handed one; mpo never does (mpo's wandb logging is mpo.trainer.metrics_log).
  Loading wandb there cost every rank, engine and test worker that imports megatron about a tenth of that import. A
  meta-path finder tells megatron's modules that wandb is not there, as `try: import wandb except ImportError`
  expects; any other importer (mpo's metrics log, a user's code) gets the real package, and nothing is put in
  sys.modules for the declined import.
"""

from __future__ import annotations

import importlib.abc
import sys

DECLINED = {"wandb": ("megatron.",)}  # module -> importers (module name prefixes) that do not get it


class _Decline(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib's protocol
        prefixes = DECLINED.get(fullname)
        if prefixes:
            importer = _importer()
            if importer.startswith(prefixes):
                raise ModuleNotFoundError(f"mpo.lean_imports declines {fullname} for {importer}", name=fullname)
        return None  # every other import goes on to the next finder


def _importer() -> str:
    """The module whose `import` statement is running (the first frame outside importlib's machinery)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def install() -> None:
    """Idempotent; first on sys.meta_path."""
    if not any(isinstance(finder, _Decline) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Decline())
