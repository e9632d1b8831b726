"""Issue 49, item 5 and part of 8: what a user sees of a run: a line per step without the progress bar, a summary at
the end, a plot (`mpo train` writes it, `mpo plot RUN` too), evaluation lines on their own line above the bar, the
start-up and the warm start saying what they do (and the warm start checkpointed), no megatron warnings on top.

Real throughout, on the CPU demo recipe with few steps: `mpo train` as a user types it (twice: a run that stops right
after its warm start, then the same run directory resumed to 3 RL steps), and the multi-node launcher
(`python -m launch`, one local node, its own engine process) for an uninterrupted reference run with the progress bar
on; no PYTHONWARNINGS there, as on a cluster. Three runs in all, shared by the tests through module fixtures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpo.parallel.ports import free_port

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "mpo" / "recipes" / "demo_cpu.yaml"
SETTINGS = ("schedule.sft_steps=2", "eval.every=2", "logging.checkpoint_every=2", "logging.tensorboard=false")
TIMING = re.compile(r"_s$|^(engine_busy|overlap)_frac$")  # wall-clock keys differ between any two runs
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")  # the start of a log line of a rank


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("PYTHONWARNINGS", None)  # a cluster shell has none
    return env


def _mpo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpo.cli", *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """`mpo train` of 0 RL steps (the warm start only: a run that stopped right after it), then the same directory
    to 3 RL steps without the progress bar. Returns (run dir, first output, second output)."""
    out = tmp_path_factory.mktemp("user") / "run"
    common = ("train", "--config", str(RECIPE), *SETTINGS, "logging.progress=false", f"logging.out_dir={out}")
    first = _mpo(*common, "schedule.steps=0")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    state = json.loads((out / "checkpoints" / "step_0" / "trainer_state.json").read_text()) if checkpoints else {}
    second = _mpo(*common, "schedule.steps=3")
    assert second.returncode == 0, second.stderr[-3000:]
    return out, first.stdout + first.stderr, second.stdout + second.stderr, checkpoints, state


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The same run uninterrupted through the launcher, progress bar on. Returns (run dir, trainer.log text, the
    rank's own stderr as written, carriage returns and all)."""
    out = tmp_path_factory.mktemp("user") / "launched"
    job = subprocess.run([sys.executable, "-m", "launch", "--config", str(RECIPE), "--job-id", "vis",
                          "--master-port", str(free_port()), "--engine-port", str(free_port()), *SETTINGS,
                          "schedule.steps=3", "logging.progress=true", f"logging.out_dir={out}"],
                         env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert job.returncode == 0, job.stderr[-3000:]
    (node,) = (out / "launch" / "vis").glob("node0-*")
    (rank_err,) = node.glob("ranks/*/attempt_0/0/stderr.log")
    return out, (node / "trainer.log").read_text(), rank_err.read_text()


def test_user_sees_a_line_per_step_without_the_bar(resumed):
    _, _, text, _, _ = resumed
    steps = [line for line in text.splitlines() if re.search(r"INFO step \d+ \(\d of 3\): ", line)]
    assert [re.search(r"step (\d+) \((\d) of", line).groups() for line in steps] == [("0", "1"), ("1", "2"),
                                                                                      ("2", "3")], text[-3000:]
    for part in ("reward ", "exact ", "loss ", "lr ", " s/step", "tok/s"):
        assert all(part in line for line in steps), (part, steps)
    # evaluated before steps 0 and 2: those steps' lines carry the held-out metrics
    assert ["held-out mean@4" in line for line in steps] == [True, False, True], steps


def test_user_start_up_says_what_it_does(resumed):
    _, _, text, _, _ = resumed
    lines = text.splitlines()
    # the attention / expert path line (which computation runs) joined the start-up: 9 lines on a resumed run
    for expected in ("starting 1 trainer rank (torchrun); run directory", "INFO starting 1 local engine",
                     "INFO building the model", "INFO attention: megatron local (unfused); experts: ",
                     "INFO 1 engine ready"):
        assert any(expected in line for line in lines[:9]), (expected, "\n".join(lines[:10]))


def test_user_run_ends_with_a_summary_and_a_plot(resumed, tmp_path):
    out, _, text, _, _ = resumed
    summary = text[text.index("run finished: 3 RL steps"):]
    for expected in ("reward: ", "exact answers: ", "held-out mean@4: ", "(step 0) -> ", "(step 3)",
                     f"metrics: {out / 'metrics.jsonl'}", f"checkpoints: {out / 'checkpoints'}", f"mpo plot {out}"):
        assert expected in summary, (expected, summary)
    assert f"\nplot: {out / 'metrics.png'}" in text  # written by `mpo train` after the run
    assert (out / "metrics.png").stat().st_size > 10_000
    (out / "metrics.png").unlink()
    plotted = _mpo("plot", str(out), timeout=120)
    assert plotted.returncode == 0 and plotted.stderr.strip() == f"plot: {out / 'metrics.png'}", plotted.stderr
    assert (out / "metrics.png").stat().st_size > 10_000
    nothing = _mpo("plot", str(tmp_path), timeout=120)
    assert nothing.returncode == 2 and len(nothing.stderr.strip().splitlines()) == 1, nothing.stderr
    assert "metrics.jsonl does not exist" in nothing.stderr


def test_user_warm_start_shows_progress_and_a_crash_after_it_keeps_it(resumed, launched):
    """The warm start logs its steps and ends in a checkpoint (step_0, its steps counted): the resumed run does not
    repeat it and trains exactly as the uninterrupted one."""
    out, first, second, checkpoints, state = resumed
    assert re.search(r"INFO warm start step 1/2: loss \d+\.\d+ \(\d+\.\d+ s/step\)", first), first[-3000:]
    assert "INFO warm start step 2/2: loss" in first
    assert checkpoints == ["step_0"] and state["sft_steps_done"] == 2
    assert "resumed from" in second and "step_0" in second and "warm start" not in second, second[-3000:]
    reference, log, _ = launched
    assert "warm start step 1/2" in log and "warm start step 2/2" in log  # with the bar on too

    def trained(rows):
        return [{k: v for k, v in r.items() if not TIMING.search(k)} for r in rows]

    assert trained(_rows(out)) == trained(_rows(reference))


def test_user_evaluation_lines_stand_alone_above_the_bar(launched):
    """What a terminal shows of the rank's stderr: each line as left after its carriage returns."""
    _, _, raw = launched
    assert "mpo rl:" in raw and "100%" in raw  # the bar was drawn
    shown = [line.split("\r")[-1] for line in raw.split("\n")]
    evaluations = [line for line in raw.split("\n") if "evaluation before step" in line]
    assert len(evaluations) == 3, raw[-3000:]
    for line in evaluations:
        assert STAMP.match(line.split("\r")[-1]), repr(line)
    assert any(line.startswith("mpo rl: 100%") for line in shown), shown[-5:]


def test_user_launcher_trainer_log_starts_without_warnings(launched):
    _, log, _ = launched
    head = log.splitlines()[:15]
    assert head and not any("Warning" in line or "warnings.warn" in line for line in head), head
    assert "INFO building the model" in head[0], head


def test_user_print_every_n_steps_and_its_range(tmp_path, caplog):
    """logging.print_every=N: the run's first step, every N-th, and the last; a negative N is refused in one line."""
    import logging

    from mpo.config import ConfigError
    from mpo.config_checks import load_config
    from mpo.trainer.metrics_log import MetricsLog, print_interval

    config = load_config(str(RECIPE), ["logging.progress=false"])
    assert print_interval(config.logging) == 1  # the default without the bar: every step
    assert print_interval(load_config(str(RECIPE), []).logging) == 0  # with the bar: the bar
    assert print_interval(load_config(str(RECIPE), ["logging.print_every=4"]).logging) == 4
    with pytest.raises(ConfigError, match=r"^logging.print_every=-1; valid values: >= 0"):
        load_config(str(RECIPE), ["logging.print_every=-1"])
    metrics = MetricsLog(tmp_path, tensorboard=False, total_steps=12, progress=False, start_step=5, print_every=3)
    with caplog.at_level(logging.INFO, logger="mpo.trainer.metrics_log"):
        for step in range(5, 12):
            metrics.log(step, {"reward_mean": step / 10, "loss": 0.5, "lr": 1e-3})
    metrics.close()
    shown = [int(m.group(1)) for r in caplog.records if (m := re.match(r"step (\d+) \(", r.getMessage()))]
    assert shown == [5, 8, 11], caplog.text
