"""Per-step metrics to JSONL (always), TensorBoard (when installed) and Weights & Biases (logging.wandb), plus a
progress bar or a line every `logging.print_every` steps, and the end-of-run summary, on one rank."""

from __future__ import annotations

import contextlib
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


def metric_rows(out_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """A run's metrics.jsonl: the RL steps' rows, the rows with held-out metrics, and the held-out keys (eval/mean@k,
    eval/pass@k)."""
    everything = read_metrics(Path(out_dir) / "metrics.jsonl")
    rows = [r for r in everything if "reward_mean" in r]  # RL steps (the final evaluation's row is not one)
    evals = [r for r in everything if any(k.startswith("eval/mean@") for k in r)]
    return rows, evals, sorted({k for r in evals for k in r if k.startswith(("eval/mean@", "eval/pass@"))})


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


def print_interval(logging_config) -> int:
    """logging.print_every resolved: null is every step without the progress bar, none with it."""
    every = logging_config.print_every
    return every if every is not None else 0 if logging_config.progress else 1


def _number(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1000 or (value and abs(value) < 1e-3) else f"{value:.4g}"


def step_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    """One RL step in one line: reward, exact answers, loss, lr, wall time, throughput, held-out metrics if any (the
    evaluation before the step, as in its metrics row)."""
    parts = []
    for key, label in (("reward_mean", "reward"), ("reward_exact_frac", "exact")):
        if isinstance(metrics.get(key), (int, float)):
            parts.append(f"{label} {metrics[key]:.3f}")
    if metrics.get("skipped_no_signal"):
        parts.append("loss skipped (no signal)")
    elif isinstance(metrics.get("loss"), (int, float)):
        parts.append(f"loss {_number(metrics['loss'])}")
    if isinstance(metrics.get("lr"), (int, float)):
        parts.append(f"lr {metrics['lr']:.2e}")
    if isinstance(metrics.get("schedule/step_s"), (int, float)):
        parts.append(f"{metrics['schedule/step_s']:.2f} s/step")
    for key, label in (("rollout_tokens_per_s", "rollout"), ("train_tokens_per_s", "train")):
        if isinstance(metrics.get(key), (int, float)):
            parts.append(f"{label} {metrics[key]:.0f} tok/s")
    held_out = [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items()
                if k.startswith(("eval/mean@", "eval/pass@")) and isinstance(v, (int, float))]
    line = f"step {step} ({step + 1} of {total}): " + ", ".join(parts)  # `step` as in metrics.jsonl
    return line + (f"; held-out {', '.join(held_out)}" if held_out else "")


def mean_of(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else float("nan")


def run_summary(out_dir: str | Path, *, first_step: int, steps: int, seconds: float) -> str:
    """The end of a run in a few lines: steps run, reward at the start and the end, held-out metrics before and after,
    the wall time, and where the metrics, checkpoints and plot are."""
    out_dir = Path(out_dir)
    rows, evals, eval_keys = metric_rows(out_dir)
    ran = steps - first_step
    lines = [f"run finished: {ran} RL step{'s' * (ran != 1)} in {seconds:.0f} s"
             + (f" (resumed at step {first_step}; {steps} in all)" if first_step else "")]
    if rows:
        window = max(1, min(5, len(rows) // 4))
        first, last = rows[:window], rows[-window:]
        for key, label in (("reward_mean", "reward"), ("reward_exact_frac", "exact answers")):
            if any(key in r for r in rows):
                lines.append(f"  {label}: {mean_of(first, key):.3f} -> {mean_of(last, key):.3f} (mean of the first and "
                             f"last {window} of {len(rows)} steps)")
    for key in eval_keys:
        lines.append(f"  held-out {key.removeprefix('eval/')}: {evals[0].get(key, float('nan')):.3f} (step "
                     f"{evals[0]['step']}) -> {evals[-1].get(key, float('nan')):.3f} (step {evals[-1]['step']})")
    lines.append(f"  metrics: {out_dir / 'metrics.jsonl'}; checkpoints: {out_dir / 'checkpoints'}; plot: "
                 f"`mpo plot {out_dir}` writes {out_dir / 'metrics.png'}")
    return "\n".join(lines)


class MetricsLog:
    """Rank 0's metrics sinks. `wandb`: the W&B run's project, name and config (None: no W&B). `print_every`: a line
    per N-th step through this module's logger (0: none); with the progress bar, every console log line of the
    process is written above the bar (tqdm.write), so no line is glued to it."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool, total_steps: int, progress: bool,
                 start_step: int = 0, wandb: dict[str, Any] | None = None, versions_per_token: bool = False,
                 print_every: int = 0) -> None:
        self.versions_per_token = versions_per_token  # logging.versions_per_token
        self.total_steps, self.start_step, self.print_every = total_steps, start_step, print_every
        self._redirect = contextlib.ExitStack()
        self.path = Path(out_dir) / "metrics.jsonl"
        self.samples_path = Path(out_dir) / "samples.jsonl"  # a few decoded responses per step
        self.versions_path = Path(out_dir) / "versions.jsonl"  # per consumed sample, each token's policy version
        self.eval_path = Path(out_dir) / "eval.jsonl"  # per held-out prompt of each evaluation (mpo.trainer.evaluation)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.writer = None
        if tensorboard:
            with contextlib.suppress(ImportError):  # TensorBoard is optional
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"))
        self.wandb = WandbSink(out_dir, **wandb) if wandb is not None else None
        self.bar = None
        if progress:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="mpo rl", unit="step", dynamic_ncols=True)
            # Log lines (evaluations, warnings, step lines) go through tqdm.write: the bar is cleared, the line
            # written on its own, the bar redrawn below it. Until close().
            self._redirect.enter_context(logging_redirect_tqdm())

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
        every = self.print_every
        if every and progress and (step == self.start_step or (step + 1) % every == 0 or step + 1 == self.total_steps):
            log.info("%s", step_line(step, self.total_steps, metrics))
        if self.bar is not None and progress:  # a row that is no RL step (the final evaluation) moves no bar
            self.bar.update(1)
            loss = metrics.get("loss")
            self.bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                                 loss="skipped (no signal)" if metrics.get("skipped_no_signal") or loss is None
                                 else f"{loss:.4f}")

    def close(self) -> None:
        """Idempotent (the loop closes the log before its summary, and again on the way out)."""
        wandb, bar, writer, self.wandb, self.bar, self.writer = self.wandb, self.bar, self.writer, None, None, None
        if wandb is not None:
            wandb.close()
        if bar is not None:
            bar.close()
        self._redirect.close()  # console logging as before the bar
        if writer is not None:
            with writing(writer.get_logdir()):
                writer.close()
