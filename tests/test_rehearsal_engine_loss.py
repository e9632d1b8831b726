"""An engine the run did not start (rollout.urls) that is SIGKILLed mid-run is dropped from the run with one warning
line, and the run goes on with the others: rollout dispatch, the weight syncs (a `distributed` group over gloo,
formed again for the engines left) and the metrics (`engines_live`) all without it. The fast form of the
rehearsal's engine-SIGKILL case (tests/test_rehearsal.py, docs/rehearsal.md), found there: before, the next weight
sync ended the run with `/pause_generation failed: ConnectError` (exit 3). An engine that stops answering for a
while (SIGSTOP: a hung host, a long GC, a network partition) is dropped the same way and re-admitted at a later
weight sync once it answers again (SIGCONT), with that sync's weights.

Real: the `mpo train` command as a user types it, its torchrun rank, the async producer process, two mpo engine
processes (SGLang's HTTP API and its weight-update group routes) started outside the run and given by URL, gloo.
Nothing is faked; the engines are mpo's (CPU) instead of SGLang's, whose start-up takes minutes here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpo.rollout.local_engine import LocalEngineProcess

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "mpo" / "recipes" / "demo_cpu.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
STEPS = 4


@pytest.fixture
def engines(tmp_path):
    started = [LocalEngineProcess.mpo_engine(log_path=tmp_path / f"engine{i}.log", num_layers=4, topk=2).launch()
               for i in range(2)]
    try:
        for engine in started:
            engine.wait_ready()
        yield started
    finally:
        for engine in started:
            engine.stop()


def _train(engines, out_dir: Path, err_path: Path, *, kill: list, after_steps: int, signal_=signal.SIGKILL,
           then=None, steps: int = STEPS) -> int:
    """`mpo train` of the demo recipe, async, on the engines by URL with `distributed` sync; once `after_steps`
    steps are in metrics.jsonl, the engines in `kill` get `signal_` (their process groups), then `then(proc)` runs
    while the run goes on. Returns the exit code."""
    mpo = Path(sys.executable).with_name("mpo")
    urls = ",".join(e.url for e in engines)
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [str(mpo), "train", "--config", str(RECIPE), f"rollout.urls=[{urls}]", "sync.transport=distributed",
             "schedule.mode=async", f"schedule.steps={steps}", "schedule.sft_steps=0", "data.prompts_per_step=2",
             "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "algorithm.filter_zero_variance=false",
             "eval.every=0", "logging.checkpoint_every=0",
             "logging.progress=false", f"logging.out_dir={out_dir}"],
            env=ENV, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, cwd=out_dir.parent)
        try:
            metrics = out_dir / "metrics.jsonl"
            deadline = time.monotonic() + 240
            while proc.poll() is None and time.monotonic() < deadline and (
                    not metrics.exists() or len(metrics.read_text().splitlines()) < after_steps):
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before the kill:\n" + err_path.read_text()[-3000:]
            for engine in kill:
                os.killpg(engine.process.pid, signal_)
            if then is not None:
                then(proc)
            return proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def _rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_rehearsal_engine_loss_sigkilled_url_engine_is_dropped_and_the_run_finishes(engines, tmp_path):
    out_dir = tmp_path / "run"
    victim = engines[1]
    code = _train(engines, out_dir, tmp_path / "err.txt", kill=[victim], after_steps=1)
    stderr = (tmp_path / "err.txt").read_text()
    assert victim.process.poll() is not None, "the engine was not killed"
    assert code == 0, stderr[-4000:]
    rows = _rows(out_dir)
    assert [r["step"] for r in rows] == list(range(STEPS)), rows
    assert all(r["kept_samples_frac"] == 1.0 and r["loss"] == r["loss"] for r in rows), rows
    # the drop is in the metrics: both engines at step 0's sync, the survivor alone from the sync after the kill on
    assert rows[0]["engines_live"] == 2.0 and rows[-1]["engines_live"] == 1.0, [r["engines_live"] for r in rows]
    # one warning line, naming the engine and why, and nothing about it failing the run
    drops = [line for line in stderr.splitlines() if "stopped answering" in line]
    assert len(drops) == 1 and victim.url in drops[0] and "dropped from the run, 1 of 2 engines left" in drops[0], \
        stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]



def test_rehearsal_engine_loss_url_engine_that_stops_answering_is_dropped_then_readmitted(engines, tmp_path):
    """SIGSTOP after step 0: the next sync's light call (/model_info) times out and the engine is dropped (one
    line); SIGCONT once that line is out: a later sync finds it answering, re-admits it (one line) and pushes it
    that sync's weights (the engine-side checksum verifies every sync), and the run ends with both engines live."""
    out_dir, err_path = tmp_path / "run", tmp_path / "err.txt"
    sleeper = engines[1]
    steps = 6

    def wake_after_the_drop(proc) -> None:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and "stopped answering" not in err_path.read_text():
            time.sleep(0.1)
        os.killpg(sleeper.process.pid, signal.SIGCONT)

    try:
        code = _train(engines, out_dir, err_path, kill=[sleeper], after_steps=1, signal_=signal.SIGSTOP,
                      then=wake_after_the_drop, steps=steps)
    finally:
        os.killpg(sleeper.process.pid, signal.SIGCONT)
    stderr = err_path.read_text()
    assert code == 0, stderr[-4000:]
    rows = _rows(out_dir)
    live = [r["engines_live"] for r in rows]
    assert [r["step"] for r in rows] == list(range(steps)), rows
    assert live[0] == 2.0 and 1.0 in live and live[-1] == 2.0, live
    assert all(r["kept_samples_frac"] == 1.0 and r["loss"] == r["loss"] for r in rows), rows
    drops = [line for line in stderr.splitlines() if "stopped answering" in line]
    backs = [line for line in stderr.splitlines() if "answers again: re-admitted" in line]
    assert len(drops) == 1 and sleeper.url in drops[0], stderr[-4000:]
    assert len(backs) == 1 and sleeper.url in backs[0], stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
