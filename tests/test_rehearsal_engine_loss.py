"""An engine the run did not start (rollout.urls) that is SIGKILLed mid-run is dropped from the run with one warning
line, and the run goes on with the others: rollout dispatch, the weight syncs (a `distributed` group over gloo,
formed again for the engines left) and the metrics (`engines_live`) all without it. The fast form of the
rehearsal's engine-SIGKILL case (tests/test_rehearsal.py, docs/rehearsal.md), found there: before, the next weight
sync ended the run with `/pause_generation failed: ConnectError` (exit 3).

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


def _train(engines, out_dir: Path, err_path: Path, *, kill: list, after_steps: int) -> int:
    """`mpo train` of the demo recipe, async, on the engines by URL with `distributed` sync; once `after_steps`
    steps are in metrics.jsonl, the engines in `kill` are SIGKILLed (their process groups). Returns the exit code."""
    mpo = Path(sys.executable).with_name("mpo")
    urls = ",".join(e.url for e in engines)
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [str(mpo), "train", "--config", str(RECIPE), f"rollout.urls=[{urls}]", "sync.transport=distributed",
             "schedule.mode=async", f"schedule.steps={STEPS}", "schedule.sft_steps=0", "data.prompts_per_step=2",
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
                os.killpg(engine.process.pid, signal.SIGKILL)
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

