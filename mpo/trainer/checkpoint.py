"""Atomic, exactly-resumable checkpoints: every rank's model and optimizer state plus the loop's own state.

Layout: <out_dir>/checkpoints/step_<k>/{rank<r>.pt, trainer_state.json}, and <out_dir>/checkpoints/latest naming the
newest complete one. A checkpoint is written into step_<k>.tmp and renamed only when every rank has finished, then
`latest` is replaced atomically: a crash mid-save leaves the previous checkpoint intact and selected. Loading uses
torch.load(weights_only=True): tensors and plain containers only, no pickled code.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpo.lifecycle import writing


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, out_dir: str | Path, *, keep: int = 2) -> None:
        self.root = Path(out_dir) / "checkpoints"
        self.keep = keep

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if path.is_dir() else None

    def save(self, step: int, rank_state: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """Collective: every rank passes its own state; rank 0 also writes trainer_state."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        if rank == 0:
            for stale in self.root.glob("step_*.tmp"):  # partial saves of a crashed run (a full disk): free the space
                shutil.rmtree(stale, ignore_errors=True)
            with writing(tmp):
                tmp.mkdir(parents=True)
        _barrier()
        rank_file = tmp / f"rank{rank}.pt"
        # A full disk stops the run here (NoSpaceLeft) with `latest` still naming the previous checkpoint; the partial
        # step_<k>.tmp is removed by the next save (not now: other ranks may still be writing into it).
        with writing(rank_file), open(rank_file, "wb") as f:
            torch.save(rank_state, f)  # an open file, not a path: see mpo.lifecycle.writing
        if rank == 0:
            state_file = tmp / "trainer_state.json"
            with writing(state_file):
                state_file.write_text(json.dumps(trainer_state, indent=1))
        _barrier()
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer_tmp = self.root / "latest.tmp"
            with writing(pointer_tmp):
                pointer_tmp.write_text(final.name)
            os.replace(pointer_tmp, self.root / "latest")
            self._prune(keep_name=final.name)
        _barrier()
        return final

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        rank_file = path / f"rank{rank}.pt"
        if not rank_file.exists():
            raise FileNotFoundError(f"checkpoint {path} has no {rank_file.name}: was it written with another "
                                    "world size? Resume needs the same parallel layout")
        rank_state = torch.load(rank_file, weights_only=True)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        return rank_state, trainer_state

    def _prune(self, keep_name: str) -> None:
        steps = sorted((p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                       key=lambda p: int(p.name.split("_")[1]))
        for old in steps[: -self.keep]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
