"""Loading of the float64 golden files for data-driven tests.

The files are vendored under ``tests/golden/`` (copied from the project's shared/golden, which holds their sources and
generator), so a clone of this repository alone runs the golden tests. ``$MPO_GOLDEN_LOSSES`` and
``$MPO_GOLDEN_ALGOS`` point every loader (test processes and the ranks they spawn alike) at another copy.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
GOLDEN_FILES = {  # environment override -> vendored default
    "MPO_GOLDEN_LOSSES": GOLDEN_DIR / "losses.json",
    "MPO_GOLDEN_ALGOS": GOLDEN_DIR / "algorithms_v2.json",
}

# Golden loss names that are not registry names: the reference calls GRPO/DAPO/Dr.GRPO "ppo_clip" (its config says which).
GOLDEN_LOSS_ALIASES = {"ppo_clip": "grpo"}


def golden_path(variable: str = "MPO_GOLDEN_LOSSES") -> Path:
    """The golden file behind `variable`: its value if set, else the vendored copy."""
    return Path(os.environ.get(variable) or GOLDEN_FILES[variable])


@lru_cache(maxsize=None)
def _load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def load_golden() -> dict[str, Any]:
    """tests/golden/losses.json: float64 cases of the policy losses, advantages and KL."""
    return _load(golden_path("MPO_GOLDEN_LOSSES"))


def load_golden_algos() -> dict[str, Any]:
    """tests/golden/algorithms_v2.json: token-level estimators, critic terms, DPPO, rollout correction."""
    return _load(golden_path("MPO_GOLDEN_ALGOS"))


def golden_section(key: str) -> list[dict[str, Any]]:
    return load_golden().get(key, [])


def t64(x: Any) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def case_id(prefix: str, i: int, label: str) -> str:
    return f"golden-{prefix}-{i:02d}-{label}"
