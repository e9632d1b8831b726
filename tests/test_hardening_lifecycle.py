"""Process lifecycle (issue 12, items 1-5): nothing outlives a killed launcher, one run per run directory, a torn
metrics tail and a full disk do not break a run or its resume.

Real: `mpo demo`/`mpo train` with torchrun, two gloo ranks and mpo's engine; kill -9 from outside; flock between two
processes; a full disk is a real, small tmpfs (mounting needs root: without it those tests skip and say so). Faked:
in the lock test, torchrun behind the CLI is replaced by a recorder (the test is about the refusal before it).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers.procs import live_processes_with_env

import mpo.cli
from mpo.lifecycle import NoSpaceLeft
from mpo.trainer.metrics_log import MetricsLog, read_metrics

MARKER = "MPO_HARDENING_RUN"  # set in the environment of everything a test starts: found again in /proc
GONE_WITHIN_S = 10.0


def _marked_env(run_id: str) -> dict[str, str]:
    return {**os.environ, MARKER: run_id, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _assert_all_gone(run_id: str, after: str) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < GONE_WITHIN_S:
        alive = live_processes_with_env(MARKER, run_id)
        if not alive:
            return
        time.sleep(0.2)
    alive = live_processes_with_env(MARKER, run_id)
    for pid in alive:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    pytest.fail(f"{len(alive)} process(es) still alive {GONE_WITHIN_S:.0f} s after {after}:\n" +
                "\n".join(f"  {pid}: {cmd[:160]}" for pid, cmd in alive.items()))


def _roles(run_id: str) -> tuple[list[int], list[int]]:
    procs = live_processes_with_env(MARKER, run_id)
    ranks = [pid for pid, cmd in procs.items()
             if "-m mpo.trainer" in cmd and not any(launcher in cmd for launcher in ("torchrun", "distributed.run"))]
    engines = [pid for pid, cmd in procs.items() if "-m mpo.engine" in cmd]
    return ranks, engines


# -- 1. kill -9 of the launcher's process group ---------------------------------------------------------------------
def test_hardening_kill9_of_demo_process_group_leaves_no_process(tmp_path):
    """`kill -9 -- -PGID` of `mpo demo` at a random moment after the ranks and the engine are up: within 10 s no
    process of the run is alive (torchrun puts ranks in their own sessions, the engine is in its own too). At two
    ranks (the demo runs one), so that more than one rank must go."""
    run_id = uuid.uuid4().hex
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "mpo.cli", "demo", "--steps", "3", "--out", str(out), "logging.progress=false",
               "logging.tensorboard=false", "world_size=2", "parallel.expert_parallel=2"]
    with (tmp_path / "demo.log").open("w") as log:
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_marked_env(run_id),
                               start_new_session=True)
    try:
        def all_up() -> bool:
            ranks, engines = _roles(run_id)
            return (len(ranks) == 2 and len(engines) == 1) or job.poll() is not None

        _wait_for(all_up, 300, "2 trainer ranks and an engine")
        time.sleep(random.uniform(0.0, 3.0))
        log_tail = (tmp_path / "demo.log").read_text()[-2000:]
        assert job.poll() is None, f"the run ended before it could be killed:\n{log_tail}"
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        _assert_all_gone(run_id, "kill -9 of the launcher's process group")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


_AGENT = """
import sys
from launch.agent import Agent
from launch.plan import NodePlan, Plan, Process
tmp = sys.argv[1]
sleeper = (sys.executable, "-c", "import time; time.sleep(600)")
parts = (Process(name="trainer", kind="trainer", argv=sleeper, log=tmp + "/trainer.log"),
         Process(name="engine0", kind="engine", argv=sleeper, log=tmp + "/engine0.log"))
node = NodePlan(node_rank=0, host="127.0.0.1", role="trainer+rollout", processes=parts, log_dir=tmp)
plan = Plan(nodes=(node,), placement="external", engine_urls=(), trainer_overrides=(), resolved_config="a: 1\\n",
            resolved_config_path=tmp + "/config.yaml", run_dir=tmp, done_marker=tmp + "/trainer.exit")
sys.exit(Agent(plan, 0, poll_s=0.1).run())
"""


def test_hardening_kill9_of_launch_agent_leaves_no_process(tmp_path):
    """The multi-node agent (launch/agent.py) killed with SIGKILL runs no teardown: its trainer and engine, each in
    its own session, must still die with it. Fake: both are sleeping Python processes (the real commands run in
    tests/test_slurm_cluster.py)."""
    run_id = uuid.uuid4().hex
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, str(tmp_path)], env=_marked_env(run_id),
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(live_processes_with_env(MARKER, run_id)) == 3, 60, "the agent's two processes")
        agent.kill()
        agent.wait()
        _assert_all_gone(run_id, "kill -9 of the launch agent")
    finally:
        agent.kill()
        agent.wait()


# -- 2. the engine's starter dies while the engine loads -------------------------------------------------------------
_STARTER = """
import sys, threading, time
from pathlib import Path
from mpo.rollout.local_engine import LocalEngineProcess
engine = LocalEngineProcess.mpo_engine(log_path=Path(sys.argv[1]), extra_args=["--preset", "tiny"])
if sys.argv[2] == "thread":  # as the rollout pool restarts an engine: from a worker thread that then ends
    starter = threading.Thread(target=engine.start)
    starter.start()
    starter.join()
    print("ready", flush=True)
    time.sleep(600)
engine.start()
"""


def _start_starter(tmp_path: Path, run_id: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _STARTER, str(tmp_path / "engine.log"), mode],
                            env=_marked_env(run_id), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_hardening_engine_dies_when_its_starter_dies_while_it_loads(tmp_path):
    """Rank 0 (here a stand-in process that starts the engine as rank 0 does) is killed while its engine is still
    importing torch / building the model: the engine must not live on."""
    run_id = uuid.uuid4().hex
    starter = _start_starter(tmp_path, run_id, "main")
    try:
        engine = _wait_for(lambda: _roles(run_id)[1], 120, "the engine process", poll_s=0.02)[0]
        starter.kill()
        starter.wait()
        log = tmp_path / "engine.log"
        assert "serving" not in (log.read_text() if log.exists() else ""), "the engine loaded before the kill"
        _assert_all_gone(run_id, f"its starter was killed while engine {engine} was loading")
    finally:
        starter.kill()
        starter.wait()


def test_hardening_engine_started_from_a_thread_outlives_the_thread_not_the_process(tmp_path):
    """PR_SET_PDEATHSIG fires when the *thread* that forked exits: an engine restarted from a worker thread (the
    rollout pool does so) must keep serving after that thread ends, and still die with the process."""
    run_id = uuid.uuid4().hex
    starter = _start_starter(tmp_path, run_id, "thread")
    try:
        assert starter.stdout.readline().strip() == "ready", (tmp_path / "engine.log").read_text()[-2000:]
        time.sleep(2.0)  # longer than the parent watchdog's period
        engines = _roles(run_id)[1]
        assert len(engines) == 1, "the engine died with the thread that started it"
        starter.kill()
        starter.wait()
        _assert_all_gone(run_id, "its starter was killed")
    finally:
        starter.kill()
        starter.wait()


# -- 3. one run per run directory -----------------------------------------------------------------------------------
_HOLDER = """
import sys, time
from mpo.lifecycle import lock_run_dir
lock = lock_run_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_hardening_second_run_into_same_out_fails_in_one_line(tmp_path, monkeypatch, capsys):
    """While another live process holds the run directory, `mpo demo --out` of it fails in one line naming the
    holder and starts nothing; once the holder is dead (kill -9: no clean-up), the directory is free again.
    Fake: torchrun is replaced by a recorder (`subprocess.call` in mpo.cli)."""
    out = tmp_path / "run"
    started: list[list[str]] = []
    monkeypatch.setattr(mpo.cli.subprocess, "call", lambda command, **_: started.append(command) or 0)
    monkeypatch.setattr(mpo.cli, "summarize_demo", lambda out_dir: "summary")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code = mpo.cli.main(["demo", "--out", str(out)])
        err = capsys.readouterr().err
        assert code != 0 and not started, "a second run into a directory in use was started"
        assert err.strip().splitlines() == [
            f"mpo: run directory {out} is in use by pid {holder.pid} on host {os.uname().nodename}"]
        assert not (out / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    assert mpo.cli.main(["demo", "--out", str(out)]) == 0 and len(started) == 1
    assert "mpo.trainer" in started[0]


# -- 4. a torn last line in metrics.jsonl ----------------------------------------------------------------------------
def test_hardening_resume_drops_torn_metrics_tail(tmp_path, caplog):
    """A crash (or a full disk) mid-append leaves a cut line at the end of metrics.jsonl: resume keeps the whole
    lines up to the checkpoint, drops the torn one with a warning, and appends after it cleanly."""
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(5))
    path.write_text(whole + '{"step": 5, "reward_me')
    log = MetricsLog(tmp_path, tensorboard=False, total_steps=10, progress=False, start_step=4)
    with caplog.at_level(logging.WARNING):
        log.truncate_after(3)
    assert "torn" in caplog.text
    log.log(4, {"reward_mean": 0.5})
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    path.write_text(whole + '{"step": 5, "rew')  # the demo's summary reads the same file
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]
    assert "demo.png" in mpo.cli.summarize_demo(tmp_path)


# -- 5. a full disk ---------------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of a given size (tmpfs); needs root (mount)."""
    mounts = []

    def make(size: str) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_hardening_full_disk_metrics_append_names_the_file(small_disk):
    """Appending metrics to a full disk stops with NoSpaceLeft naming metrics.jsonl (a checkpoint that does not fit is
    the `mpo train` test below: torch_dist's writers report it, and the previous checkpoint stays selected)."""
    disk = small_disk("1m")
    log = MetricsLog(disk, tensorboard=False, total_steps=2, progress=False)
    with pytest.raises(NoSpaceLeft, match="while writing metrics.jsonl"):
        log.log(1, {"note": "x" * 2_000_000})


def test_hardening_full_disk_stops_train_with_one_line(tmp_path, small_disk):
    """`mpo train` (torchrun, 2 ranks, engine) into a 7 MB disk: step 1's checkpoint (~4.5 MB for the tiny model)
    fits, step 2's does not. The run exits non-zero with exactly one line of its own (no tracebacks, not one per
    rank) naming the place and the file; checkpoint step_1 stays selected; no process of the run is left."""
    disk = small_disk("7m")
    run_id = uuid.uuid4().hex
    command = [sys.executable, "-m", "mpo.cli", "train", "--config", str(Path(mpo.cli.RECIPES) / "demo_cpu.yaml"),
               f"logging.out_dir={disk / 'run'}", "schedule.steps=2", "schedule.sft_steps=0",
               "logging.checkpoint_every=1", "logging.progress=false"]  # TensorBoard on: its writer thread fails too
    done = subprocess.run(command, env=_marked_env(run_id), capture_output=True, text=True, timeout=600)
    mpo_lines = [line for line in done.stderr.splitlines() if line.startswith("mpo")]
    assert done.returncode != 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "FAILED" not in done.stderr, done.stderr[-3000:]
    assert len(mpo_lines) == 1, done.stderr[-3000:]
    assert mpo_lines[0].startswith(f"mpo: no space left on {disk / 'run' / 'checkpoints' / 'step_2.tmp'} "
                                   "while writing "), mpo_lines
    assert (disk / "run" / "checkpoints" / "latest").read_text().strip() == "step_1"
    _assert_all_gone(run_id, "the run stopped")


# -- the off-policy rollout producer: a child process of rank 0 ------------------------------------------------------
def _async_train(out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "mpo.cli", "train", "--config", str(Path(mpo.cli.RECIPES) / "demo_cpu.yaml"),
            f"logging.out_dir={out}", f"schedule.steps={steps}", "schedule.sft_steps=0", "schedule.mode=async",
            "logging.checkpoint_every=0", "logging.progress=false", "logging.tensorboard=false"]


def _producer_pids(text: str) -> tuple[int, int] | None:
    """(rank 0's pid, the producer's) from rank 0's start-up line, once it is written."""
    found = re.search(r"rank(\d+) INFO rollout producer: process (\d+)", text)
    return (int(found[1]), int(found[2])) if found else None


def _async_run_killed(out, log_path, run_id: str, *, victim: str) -> tuple[subprocess.Popen, int, int]:
    """An async `mpo train` of 500 steps logging to `log_path`, its `victim` ("producer" or "rank0") SIGKILLed after
    two steps; (the ended job, rank 0's pid, the producer's pid). The producer is checked to be a child process of
    rank 0, not a thread of it."""
    with log_path.open("w") as log:
        job = subprocess.Popen(_async_train(out, 500), stdout=log, stderr=subprocess.STDOUT, env=_marked_env(run_id),
                               start_new_session=True)
        try:
            rank0, producer = _wait_for(lambda: _producer_pids(log_path.read_text()), 300, "the producer's line")
            with open(f"/proc/{producer}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[1]) == rank0
            metrics = out / "metrics.jsonl"
            _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 300, "two steps")
            os.kill(producer if victim == "producer" else rank0, signal.SIGKILL)
            job.wait(timeout=120)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    return job, rank0, producer


def test_hardening_async_producer_is_a_child_process_stopped_with_the_run_and_its_death_is_one_line(tmp_path):
    """schedule.mode=async: rank 0's rollouts are collected in a child process of rank 0 (mpo.trainer.producer: HTTP,
    decoding, scoring and advantages off the training loop's GIL). A producer SIGKILLed mid-run stops the run
    promptly (no hang) with one line naming it, no traceback, and no process of the run is left. (That a finished
    async run leaves no process behind is asserted on tests/test_demo.py's async run, which finishes after its
    restart: one `mpo` run fewer here.)"""
    run_id = uuid.uuid4().hex
    log_path = tmp_path / "killed.log"
    job, rank0, producer = _async_run_killed(tmp_path / "killed", log_path, run_id, victim="producer")
    text = log_path.read_text()
    mpo_lines = [line for line in text.splitlines() if line.startswith("mpo")]
    assert job.returncode != 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert mpo_lines == [f"mpo: rollout producer failed: the rollout producer process (pid {producer}) was killed by "
                         "SIGKILL (its last lines are in the log above)"], text[-3000:]
    _assert_all_gone(run_id, "the producer was killed")


def test_hardening_async_producer_dies_with_rank0(tmp_path):
    """SIGKILL of rank 0 alone in async mode: its producer process goes with it (PR_SET_PDEATHSIG), torchrun ends the
    other rank, and no process of the run is left."""
    run_id = uuid.uuid4().hex
    job, _, _ = _async_run_killed(tmp_path / "run", tmp_path / "run.log", run_id, victim="rank0")
    assert job.returncode != 0
    _assert_all_gone(run_id, "rank 0 was killed")


def test_ctrl_c_that_a_library_wrapped_is_still_a_ctrl_c(monkeypatch):
    """Ctrl-C landing inside megatron's checkpoint write: its writer catches the KeyboardInterrupt and raises a
    CheckpointException instead, and the rank printed that traceback (seen once in the suite's Ctrl-C test). The rank
    notes SIGINT itself, so it still ends as an interrupted run (130, no traceback; `mpo train` says how to resume).
    Real: the signal, delivered to this process. Faked: the run is a function that wraps the interrupt as megatron's
    writer does (timing a real Ctrl-C into a checkpoint write is a race)."""
    import mpo.config_checks
    import mpo.trainer.loop
    from mpo.trainer.__main__ import main

    def run_wrapping_the_interrupt(config):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises KeyboardInterrupt here
        except KeyboardInterrupt as exc:
            raise RuntimeError("Worker failure: An error is caught while starting worker 0") from exc
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setattr(mpo.config_checks, "load_config", lambda path, overrides: None)
    monkeypatch.setattr(mpo.trainer.loop, "run", run_wrapping_the_interrupt)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert main(["--config", "unused.yaml"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
