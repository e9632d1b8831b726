"""Loading of the float64 golden file shared/golden/losses.json (spec section 9) for data-driven tests."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GOLDEN = REPO_ROOT / ".." / "shared" / "golden" / "losses.json"

# Golden loss names that are not registry names: the reference calls GRPO/DAPO/Dr.GRPO "ppo_clip" (its config says which).
GOLDEN_LOSS_ALIASES = {"ppo_clip": "grpo"}


def golden_path() -> Path:
    return Path(os.environ.get("MPO_GOLDEN_LOSSES", DEFAULT_GOLDEN))


@lru_cache(maxsize=1)
def load_golden() -> dict[str, Any]:
    with open(golden_path()) as f:
        return json.load(f)


def golden_section(key: str) -> list[dict[str, Any]]:
    return load_golden().get(key, [])


def t64(x: Any) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def case_id(prefix: str, i: int, label: str) -> str:
    return f"golden-{prefix}-{i:02d}-{label}"
