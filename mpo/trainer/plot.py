"""A run's curves as one PNG (`mpo plot RUN`, written by `mpo train` and `mpo demo` at the end of a run) and the demo's
before/after table, both from RUN/metrics.jsonl.

The plot has three panels over RL steps: reward (mean, exact answers, held-out mean@k / pass@k where evaluated), the
policy loss, and top-k routing agreement (engine vs old forward, old forward vs update). matplotlib and the JSONL
reader only, no torch: `mpo plot` starts fast.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mpo.trainer.metrics_log import mean_of, metric_rows

ROUTING = (("routing/rollout_vs_old/exact_match", "engine vs old forward"),
           ("routing/old_vs_update/exact_match", "old forward vs update"))


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] if isinstance(r.get(key), (int, float)) else math.nan for r in rows]


def write_plot(out_dir: str | Path, path: str | Path | None = None) -> Path | None:
    """Write the run's plot to `path` (default RUN/metrics.png); None when the run has no RL step yet."""
    out_dir = Path(out_dir)
    rows, evals, eval_keys = metric_rows(out_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    path = Path(path) if path is not None else out_dir / "metrics.png"
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    ax1.plot(steps, _series(rows, "reward_mean"), label="reward (mean)")
    if any("reward_exact_frac" in r for r in rows):
        ax1.plot(steps, _series(rows, "reward_exact_frac"), label="exact answers")
    for key in eval_keys:
        ax1.plot([r["step"] for r in evals], _series(evals, key), marker="o", linestyle="--",
                 label=f"held-out {key.removeprefix('eval/')}")
    ax1.set_ylabel("reward")
    ax1.legend(fontsize="small")
    ax2.plot(steps, _series(rows, "loss"), label="policy loss")
    ax2.set_ylabel("loss")
    for key, label in ROUTING:
        ax3.plot(steps, _series(rows, key), label=label)
    ax3.set_ylabel("top-k routing agreement")
    ax3.set_xlabel("RL step")
    ax3.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def before_after(out_dir: str | Path) -> str:
    """The demo's table: reward and exact answers over the first and last few RL steps, held-out metrics at the first
    and last evaluation."""
    rows, evals, eval_keys = metric_rows(out_dir)
    if not rows:
        return "no metrics were written"
    window = max(1, min(5, len(rows) // 4))
    before, after = rows[:window], rows[-window:]
    lines = [f"{'':28s}{'before RL':>12s}{'after RL':>12s}",
             f"{'reward (mean)':28s}{mean_of(before, 'reward_mean'):12.3f}{mean_of(after, 'reward_mean'):12.3f}",
             f"{'exact answers (fraction)':28s}{mean_of(before, 'reward_exact_frac'):12.3f}"
             f"{mean_of(after, 'reward_exact_frac'):12.3f}",
             f"(mean of the first and last {window} of {len(rows)} RL steps)"]
    for key in eval_keys:
        lines.append(f"{'held-out ' + key.removeprefix('eval/'):28s}{evals[0][key]:12.3f}{evals[-1][key]:12.3f}")
    if evals:
        lines.append(f"(held-out evaluations: before RL step {evals[0]['step']}, after {evals[-1]['step']} RL steps)")
    return "\n".join(lines)
