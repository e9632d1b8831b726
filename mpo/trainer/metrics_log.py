"""Per-step metrics to JSONL (always), TensorBoard (when installed) and Weights & Biases (logging.wandb), plus a
progress bar, on one rank."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

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


def wandb_settings(config) -> dict[str, Any] | None:
    """MetricsLog's `wandb` argument for a TrainConfig: logging.wandb_project, logging.wandb_run_name and the whole
    config as the W&B run's config (None when logging.wandb is off)."""
    from mpo.config import to_dict

    lg = config.logging
    return {"project": lg.wandb_project, "name": lg.wandb_run_name, "config": to_dict(config)} if lg.wandb else None


class WandbSink:
    """Every metrics row to a W&B run whose files live under `out_dir`/wandb (WANDB_MODE=offline: nothing leaves the
    machine; `wandb sync` uploads it later). W&B failing (no API key, the network gone) costs a log line, never the
    run: metrics.jsonl holds everything. A resumed run starts a new W&B run that logs from the resumed step on."""

    def __init__(self, out_dir: str | Path, *, project: str, name: str | None, config: dict[str, Any]) -> None:
        self.run = None
        try:
            import wandb
        except ImportError:  # config validation says so first; this is a rank 0 on a node without the package
            log.error("logging.wandb=true needs the wandb package: pip install 'mpo[wandb]'; metrics go to "
                      "metrics.jsonl only")
            return
        try:
            self.run = wandb.init(project=project, name=name, dir=str(out_dir), config=config)
        except Exception as exc:  # noqa: BLE001 - W&B's errors are its own types (UsageError, CommError, ...)
            log.error("logging.wandb: W&B did not start (%s); metrics go to metrics.jsonl only", exc)

    def log(self, step: int, row: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)
        except Exception as exc:  # noqa: BLE001 - as above
            log.error("logging.wandb: logging step %d failed (%s); W&B logging stops, metrics.jsonl goes on", step,
                      exc)
            self.close()

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish()
            except Exception as exc:  # noqa: BLE001 - as above
                log.error("logging.wandb: finishing the W&B run failed (%s)", exc)


class MetricsLog:
    """Rank 0's metrics sinks. `wandb`: the W&B run's project, name and config (None: no W&B)."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool, total_steps: int, progress: bool,
                 start_step: int = 0, wandb: dict[str, Any] | None = None, versions_per_token: bool = False) -> None:
        self.versions_per_token = versions_per_token  # logging.versions_per_token
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
        self.wandb = WandbSink(out_dir, **wandb) if wandb is not None else None
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

    def log_versions(self, step: int, versions: list) -> None:
        """Append the policy versions of the samples consumed at `step` (per sample, one per token) to versions.jsonl:
        one row per step, ``{"step", "tokens", "min", "max", "changes"}`` with a list entry per sample (changes: how
        often the version changes between consecutive tokens), or with logging.versions_per_token ``{"step",
        "versions"}``, every token's version."""
        arrays = [np.asarray(v, dtype=np.int64) for v in versions]
        if self.versions_per_token:
            row = {"step": step, "versions": [a.tolist() for a in arrays]}
        else:
            row = {"step": step, "tokens": [int(a.size) for a in arrays],
                   "min": [int(a.min()) if a.size else None for a in arrays],
                   "max": [int(a.max()) if a.size else None for a in arrays],
                   "changes": [int(np.count_nonzero(np.diff(a))) for a in arrays]}
        with writing(self.versions_path), self.versions_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

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
        if self.wandb is not None:
            self.wandb.log(step, record)
        if self.bar is not None and progress:  # a row that is no RL step (the final evaluation) moves no bar
            self.bar.update(1)
            loss = metrics.get("loss")
            self.bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                                 loss="skipped (no signal)" if metrics.get("skipped_no_signal") or loss is None
                                 else f"{loss:.4f}")

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.close()
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            with writing(self.writer.get_logdir()):
                self.writer.close()
