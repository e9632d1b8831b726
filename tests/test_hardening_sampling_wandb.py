"""Issue 27 items 3 and 4: DAPO dynamic sampling (algorithm.dynamic_sampling) and Weights & Biases logging
(logging.wandb).

The selection logic runs on a scripted `draw` (deterministic rewards stand in for the engines: which groups are
kept must depend on the rewards only); the rounds' prompts and seeds come from the real toy task and the real
per-sample seed function. The W&B run is real (the wandb package, WANDB_MODE=offline, no network): its .wandb file
is read back record by record with wandb's own protobuf classes. Bad values go through the real `mpo check-config`
(its `main(argv)` in this process). The end-to-end check (the demo with dynamic sampling, killed and resumed
bit-exact, its W&B run holding the rows) is tests/test_demo.py::test_killed_run_resumes_bit_exact.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from helpers.wandb_files import wandb_history, wandb_offline
from mpo.config_checks import load_config

RECIPE = Path(__file__).resolve().parents[1] / "mpo" / "recipes" / "demo_cpu.yaml"


def _check_config(capsys, *overrides: str) -> tuple[int, str]:
    from mpo.cli import main

    capsys.readouterr()
    code = main(["check-config", "--config", str(RECIPE), *overrides])
    return code, capsys.readouterr().err


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("override, message", [
    ("algorithm.max_sampling_rounds=0", "algorithm.max_sampling_rounds=0; valid values: >= 1 (the first draw counts)"),
    ("algorithm.dynamic_sampling=sometimes", "algorithm.dynamic_sampling='sometimes': expected true or false"),
    ("logging.wandb_project=", "logging.wandb_project=''; valid values: a non-empty project name"),
    ("rollout.samples_per_prompt=1", "algorithm.dynamic_sampling=true needs rollout.samples_per_prompt >= 2 (got 1): "
                                     "a group of one response never has reward variance"),
])
def test_hardening_27_bad_sampling_and_wandb_values_fail_in_one_line(capsys, override, message):
    extra = ["logging.wandb=true"] if override.startswith("logging.wandb_") else \
        ["algorithm.dynamic_sampling=true", "algorithm.advantage=drgrpo"] if override.startswith("rollout.") else []
    code, err = _check_config(capsys, override, *extra)
    assert code == 2, err
    assert _one_line(err) == f"mpo: config error: {message}"


def test_hardening_27_wandb_without_the_package_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when the package is not installed
    code, err = _check_config(capsys, "logging.wandb=true")
    assert code == 2, err
    assert _one_line(err) == "mpo: config error: logging.wandb=true needs the wandb package: pip install 'mpo[wandb]'"


def _scripted(rounds: list[list[list[float]]], asked: list[int]):
    """draw(round, count): the scripted rewards of that round's first `count` groups (prompts named r.g)."""
    from mpo.trainer.dynamic_sampling import Drawn

    def draw(round_: int, count: int) -> Drawn:
        asked.append(count)
        groups = rounds[round_][:count]
        assert len(groups) == count, "the sampler asked for more groups than the script has"
        return Drawn(2, [f"{round_}.{g}" for g in range(count)], [None] * 2 * count,
                     [r for group in groups for r in group], [0.0] * 2 * count, rollout_s=1.0)

    return draw


def test_hardening_27_dynamic_sampling_keeps_the_first_varied_groups_in_draw_order():
    from mpo.trainer.dynamic_sampling import sample_varied, varied_groups

    flat, mixed = [0.0, 0.0], [0.0, 1.0]
    # 4 wanted; round 0: 2 of 4 varied; round 1 asks for the 2 missing at the 50% rate seen: 4; it has 3 varied.
    script = [[mixed, flat, [1.0, 1.0], [0.5, 0.25]], [flat, mixed, [0.1, 0.1], [1.0, 0.0]]]
    asked: list[int] = []
    out = sample_varied(_scripted(script, asked), wanted=4, max_rounds=10)
    assert asked == [4, 4] and out.rounds == 2 and not out.exhausted
    assert out.batch.prompts == ["0.0", "0.3", "1.1", "1.3"]
    assert out.batch.rewards == [0.0, 1.0, 0.5, 0.25, 0.0, 1.0, 1.0, 0.0]
    assert varied_groups(out.batch.rewards, 2) == [0, 1, 2, 3]  # nothing left for the zero-variance filter
    assert len(out.drawn) == 8 and out.drawn.rollout_s == 2.0  # every drawn group counts in the step's metrics


def test_hardening_27_dynamic_sampling_stops_at_max_rounds_and_says_so():
    from mpo.trainer.dynamic_sampling import sample_varied

    flat = [0.5, 0.5]
    script = [[flat, [0.0, 1.0], flat]] + [[flat] * 3] * 2
    asked: list[int] = []
    out = sample_varied(_scripted(script, asked), wanted=3, max_rounds=3)
    assert out.exhausted and out.rounds == 3 and asked == [3, 3, 3]  # 1 of 3 kept: 2 missing x 3 drawn per kept
    assert out.batch.prompts == ["0.1"] and len(out.drawn) == 9
    none = sample_varied(_scripted([[flat]], []), wanted=1, max_rounds=1)
    assert none.exhausted and len(none.batch) == 0 and none.batch.results == []


def test_hardening_27_each_round_draws_new_prompts_and_seeds_reproducibly():
    """Round 0 is the step's usual draw (runs without dynamic sampling unchanged); later rounds are other prompts and
    other sampling seeds, the same ones every time (resume), also under prompt retirement."""
    from mpo.data.retirement import PromptRetirement
    from mpo.trainer.tasks import ToyRun
    from mpo.trainer.collect import _sampling_seed

    config = load_config(RECIPE)
    task = ToyRun(config)
    assert task.draw(3, 16) == task.task.prompts(config.seed, 3, 16)
    rounds = [task.draw(3, 16, round_=r) for r in range(3)]
    assert rounds[1] == task.draw(3, 16, round_=1) and rounds[2] != rounds[1] != rounds[0]
    assert len({p for r in rounds for p in r}) > 40  # 3-digit numbers: a few repeats by chance, not whole rounds
    assert _sampling_seed(1234, 3, 5) == (1234 * 1_000_003 + 3 * 10_007 + 5) % (2**31 - 1)
    seeds = {_sampling_seed(1234, s, i, r) for s in range(4) for r in range(4) for i in range(128)}
    assert len(seeds) == 4 * 4 * 128
    retirement = PromptRetirement(0.0)
    retirement.observe(rounds[1][:4], [1.0] * 4)
    again = task.draw(3, 16, retirement, round_=1)
    assert again[:12] == rounds[1][4:] and not set(again) & set(rounds[1][:4])


def test_hardening_27_wandb_offline_run_holds_every_metrics_row(tmp_path, monkeypatch):
    from mpo.trainer.metrics_log import MetricsLog, wandb_settings

    pytest.importorskip("wandb", reason="logging.wandb needs pip install 'mpo[wandb]' (in tests/requirements-ci.txt)")
    wandb_offline(monkeypatch, tmp_path)
    config = load_config(RECIPE, ["logging.wandb=true", "logging.wandb_project=day-one",
                                  "logging.wandb_run_name=unit", f"logging.out_dir={tmp_path / 'run'}"])
    log = MetricsLog(tmp_path / "run", tensorboard=False, total_steps=3, progress=False,
                     wandb=wandb_settings(config))
    rows = {step: {"reward_mean": 0.25 * step, "loss": -1.5 + step, "kept_samples_frac": 1.0} for step in range(3)}
    for step, row in rows.items():
        log.log(step, row)
    log.close()
    (run_dir,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    # wandb-core (its own process) may still be flushing the run file when finish() returns on a loaded machine (a
    # CI run under load 10 read an empty history once): wait for the rows, up to 60 s
    deadline = time.monotonic() + 60
    while wandb_history(run_dir) != rows and time.monotonic() < deadline:
        time.sleep(0.5)
    assert wandb_history(run_dir) == rows


class _BrokenRun:
    """A W&B run whose server went away mid-run (cannot be had here without a network): every call raises."""

    def log(self, *args, **kwargs):
        raise ConnectionError("wandb.ai unreachable")

    def finish(self):
        raise ConnectionError("wandb.ai unreachable")


def test_hardening_27_wandb_failing_costs_a_log_line_not_the_run(tmp_path, monkeypatch, caplog):
    """No wandb package on rank 0's node (past config validation), then a run whose server is gone: each is one
    error line; metrics.jsonl keeps every row."""
    from mpo.trainer.metrics_log import MetricsLog, read_metrics

    monkeypatch.setitem(sys.modules, "wandb", None)
    settings = {"project": "p", "name": None, "config": {}}
    log = MetricsLog(tmp_path, tensorboard=False, total_steps=2, progress=False, wandb=settings)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "logging.wandb=true needs the wandb package: pip install 'mpo[wandb]'; metrics go to metrics.jsonl only"]
    caplog.clear()
    log.wandb.run = _BrokenRun()
    log.log(0, {"loss": 1.0})
    log.log(1, {"loss": 0.5})
    log.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors[0] == ("logging.wandb: logging step 0 failed (wandb.ai unreachable); W&B logging stops, "
                         "metrics.jsonl goes on") and len(errors) == 2  # and the failed finish
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 0.5]
