"""Per-step metrics to JSONL (always) and TensorBoard (when installed), plus a progress bar, on one rank."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, out_dir: str | Path, *, tensorboard: bool, total_steps: int, progress: bool,
                 start_step: int = 0) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
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
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, float) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.bar is not None:
            self.bar.update(1)
            loss = metrics.get("loss")
            self.bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                                 loss="skipped (no signal)" if loss is None else f"{loss:.4f}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
