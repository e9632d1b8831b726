"""Per-step metrics to JSONL (always) and TensorBoard (when installed), plus a progress bar, on one rank."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from mpo.lifecycle import writing

log = logging.getLogger(__name__)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a line cut short (a crash or a full disk mid-append) is dropped with a warning.

    Only whole lines are ever appended, so an unreadable line is the remains of an interrupted write: its step is
    recomputed on resume."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or "step" not in row:
            log.warning("%s line %d is torn (%d characters, not a whole JSON record); dropped", path, number,
                        len(line))
            continue
        rows.append(row)
    return rows


class MetricsLog:
    def __init__(self, out_dir: str | Path, *, tensorboard: bool, total_steps: int, progress: bool,
                 start_step: int = 0) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.samples_path = Path(out_dir) / "samples.jsonl"  # a few decoded responses per step
        self.versions_path = Path(out_dir) / "versions.jsonl"  # per consumed sample, each token's policy version
        self.eval_path = Path(out_dir) / "eval.jsonl"  # per held-out prompt of each evaluation (mpo.trainer.evaluation)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"))
            except ImportError:
                self.writer = None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="mpo rl", unit="step", dynamic_ncols=True)

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of steps after the checkpoint (they will be recomputed)."""
        for path in (self.path, self.samples_path, self.versions_path, self.eval_path):
            if not path.exists():
                continue
            kept = [row for row in read_metrics(path) if row["step"] <= step]
            tmp = path.with_name(path.name + ".tmp")
            with writing(tmp):  # replaced whole: a crash here leaves the old file, never a half-written one
                tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
            os.replace(tmp, path)

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        """Append a step's sample responses (prompt, response, answer, reward) to samples.jsonl."""
        if not rows:
            return
        with writing(self.samples_path), self.samples_path.open("a") as f:
            f.write("".join(json.dumps(row, default=str) + "\n" for row in rows))

    def log_eval(self, rows: list[dict[str, Any]]) -> None:
        """Append one evaluation's per-prompt rows to eval.jsonl."""
        with writing(self.eval_path), self.eval_path.open("a") as f:
            f.write("".join(json.dumps(row, default=str) + "\n" for row in rows))

    def log_versions(self, step: int, versions: list[list[int]]) -> None:
        """Append the policy version of every token of every sample consumed at `step` to versions.jsonl."""
        with writing(self.versions_path), self.versions_path.open("a") as f:
            f.write(json.dumps({"step": step, "versions": versions}) + "\n")

    def log(self, step: int, metrics: dict[str, Any], *, progress: bool = True) -> None:
        record = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with writing(self.path), self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            with writing(self.writer.get_logdir()):  # its writer thread fails first; this re-raises the OSError
                for key, value in record.items():
                    if isinstance(value, float) and math.isfinite(value):
                        self.writer.add_scalar(key, value, step)
                self.writer.flush()
        if self.bar is not None and progress:  # a row that is no RL step (the final evaluation) moves no bar
            self.bar.update(1)
            loss = metrics.get("loss")
            self.bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                                 loss="skipped (no signal)" if metrics.get("skipped_no_signal") or loss is None
                                 else f"{loss:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            with writing(self.writer.get_logdir()):
                self.writer.close()
