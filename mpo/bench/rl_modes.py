"""The demo config in the three schedule modes (sync, one_step_off, async), one after the other in one run:
RL steps/s (wall time of the RL steps, from the first step's end to the last's, so start-up and the warm start are
excluded), the rollout engines' busy fraction (mean of engine_busy_frac), the mean staleness, and the final reward
(mean reward and exact-answer fraction of the last 5 steps). The off-policy modes run with their defaults
(algorithm.rollout_correction and algorithm.replay unset: the decoupled objective with a truncated behaviour weight,
tis_token, and the engine's routes replayed, r3).

Last line: `rl-modes sync_exact=<a> one_step_off_exact=<b> async_exact=<c> async_steps_per_s_vs_sync=<d>` (exact:
mean reward_exact_frac of the last 5 steps; d: async RL steps/s over sync's, both measured in this run).

Each mode is a real `mpo demo` run (torchrun, the demo's gloo rank, the mpo engine). On a 2-core CPU box trainer
and engine share the cores: with the demo's one rank each can have a core, so overlap pays here. The busy fraction
shows what the schedule changes; the real throughput gain needs engines on their own devices (GPUs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_mode(mode: str, out: Path, steps: int, extra: list[str]) -> dict[str, float]:
    from mpo.bench._util import run_demo

    rows, wall = run_demo(out, steps, [f"schedule.mode={mode}", *extra], out.parent / f"{mode}.log", f"mode {mode}")
    # schedule/step_s: wall time from the previous step's end to this one's (step 0's includes the first rollout)
    step_s = [r["schedule/step_s"] for r in rows[1:]]
    last = rows[-5:]
    return {"steps_per_s": len(step_s) / sum(step_s), "engine_busy_frac": _mean([r["engine_busy_frac"] for r in rows[1:]]),
            "overlap_frac": _mean([r["overlap_frac"] for r in rows[1:]]),
            "staleness_mean": _mean([r["staleness_mean"] for r in rows]),
            "reward_mean_last5": _mean([r["reward_mean"] for r in last]),
            "exact_frac_last5": _mean([r["reward_exact_frac"] for r in last]), "wall_s": wall}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench rl_modes", description=__doc__)
    parser.add_argument("--steps", type=int, default=None, help="RL steps per mode (default: the demo's)")
    parser.add_argument("--modes", default="sync,one_step_off,async")
    parser.add_argument("--max-staleness", type=int, default=2, help="schedule.max_staleness of the async run")
    parser.add_argument("overrides", nargs="*", help="section.field=value, for every mode")
    args = parser.parse_args(argv)
    from mpo.config import RECIPES
    from mpo.config_checks import load_config

    steps = args.steps or load_config(RECIPES / "demo_cpu.yaml").schedule.steps
    results = {}
    with tempfile.TemporaryDirectory(prefix="mpo-rl-modes-") as tmp:
        for mode in args.modes.split(","):
            extra = [*args.overrides, *([f"schedule.max_staleness={args.max_staleness}"] if mode == "async" else [])]
            results[mode] = run_mode(mode, Path(tmp) / mode, steps, extra)
            print(f"{mode}: done in {results[mode]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print(f"demo config, {steps} RL steps per mode (async: max_staleness={args.max_staleness}), one run")
    print(f"{'mode':14s}{'steps/s':>9s}{'engine busy':>13s}{'overlap':>9s}{'staleness':>11s}"
          f"{'reward (last 5)':>17s}{'exact (last 5)':>16s}{'wall s':>8s}")
    for mode, r in results.items():
        print(f"{mode:14s}{r['steps_per_s']:9.3f}{r['engine_busy_frac']:13.2f}{r['overlap_frac']:9.2f}"
              f"{r['staleness_mean']:11.2f}{r['reward_mean_last5']:17.3f}{r['exact_frac_last5']:16.3f}"
              f"{r['wall_s']:8.0f}")
    if {"sync", "one_step_off", "async"} <= set(results):
        print(f"rl-modes sync_exact={results['sync']['exact_frac_last5']:.3f} "
              f"one_step_off_exact={results['one_step_off']['exact_frac_last5']:.3f} "
              f"async_exact={results['async']['exact_frac_last5']:.3f} "
              f"async_steps_per_s_vs_sync={results['async']['steps_per_s'] / results['sync']['steps_per_s']:.3f}")
    return 0
