"""launch/agent.py on this machine, without Slurm: failure detection, naming the failed part, and teardown.

Faked: the trainer and engine commands are small Python processes (exit with a code, sleep, spawn a grandchild)
instead of torchrun and engine servers, so that each failure happens at a known moment; the agent, its process
groups, signals and files are real. The real commands run in tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from launch.agent import Agent
from launch.plan import NodePlan, Plan, Process

SLEEPER = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
           " open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(300)")


def _plan(tmp: Path, trainer_code: str, *, engine: bool = True) -> Plan:
    procs = [Process(name="trainer", kind="trainer", argv=(sys.executable, "-c", trainer_code),
                     log=str(tmp / "trainer.log"))]
    if engine:
        procs.append(Process(name="engine0", kind="engine",
                             argv=(sys.executable, "-c", SLEEPER, str(tmp / "grandchild.pid")),
                             log=str(tmp / "engine0.log")))
    node = NodePlan(node_rank=0, host="127.0.0.1", role="trainer+rollout", processes=tuple(procs), log_dir=str(tmp))
    return Plan(nodes=(node,), placement="external", engine_urls=(), trainer_overrides=(), resolved_config="a: 1\n",
                resolved_config_path=str(tmp / "config.yaml"), run_dir=str(tmp), done_marker=str(tmp / "trainer.exit"))


def _gone(pid: int) -> bool:
    """True once `pid` has exited (SIGKILL to a grandchild is delivered asynchronously: allow it a moment)."""
    for _ in range(40):
        if _exited(pid):
            return True
        time.sleep(0.05)
    return False


def _exited(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # reaped late by PID 1 in a container without an init that reaps


def _grandchild(tmp: Path) -> int:
    for _ in range(100):
        text = (tmp / "grandchild.pid").read_text() if (tmp / "grandchild.pid").exists() else ""
        if text:
            return int(text)
        time.sleep(0.05)
    raise AssertionError("engine never started its child")


def test_failed_trainer_stops_engine_and_its_children(tmp_path, capsys):
    plan = _plan(tmp_path, "import sys, time; time.sleep(1.5); print('boom'); sys.exit(3)")
    agent = Agent(plan, 0, poll_s=0.1)
    assert agent.run() == 3
    err = capsys.readouterr().err
    assert f"node 0 (127.0.0.1): FAILED: trainer exited with code 3; log: {tmp_path / 'trainer.log'}" in err
    assert "| boom" in err
    assert all(_gone(r.popen.pid) for r in agent.running) and _gone(_grandchild(tmp_path))
    assert (tmp_path / "trainer.exit").read_text().strip() == "3"  # other nodes' engines stop on it
    assert oct((tmp_path / "config.yaml").stat().st_mode & 0o777) == "0o600"


def test_engine_death_fails_the_node(tmp_path, capsys):
    plan = _plan(tmp_path, "import time; time.sleep(300)")

    def kill_engine():
        os.kill(_grandchild(tmp_path), 0)
        engine = next(r for r in agent.running if r.spec.name == "engine0")
        os.kill(engine.popen.pid, signal.SIGKILL)

    agent = Agent(plan, 0, poll_s=0.1)
    threading.Timer(1.0, kill_engine).start()
    assert agent.run() == 1
    assert "FAILED: engine0 was killed by SIGKILL" in capsys.readouterr().err
    assert all(_gone(r.popen.pid) for r in agent.running) and _gone(_grandchild(tmp_path))


def test_sigterm_tears_down(tmp_path, capsys):
    plan = _plan(tmp_path, "import time; time.sleep(300)")
    agent = Agent(plan, 0, poll_s=0.1)
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    assert agent.run() == 128 + signal.SIGTERM
    assert "received SIGTERM: stopping 2 process(es)" in capsys.readouterr().err
    assert all(_gone(r.popen.pid) for r in agent.running) and _gone(_grandchild(tmp_path))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_success_stops_engines_after_done_marker(tmp_path, capsys):
    # The "trainer" finishes once the engine is fully up (its child's pid written), so teardown has a child to stop.
    wait = f"import os, time\nwhile not os.path.getsize({str(tmp_path / 'grandchild.pid')!r}) if os.path.exists(" \
           f"{str(tmp_path / 'grandchild.pid')!r}) else True: time.sleep(0.05)\nprint('trained')"
    plan = _plan(tmp_path, wait)
    agent = Agent(plan, 0, poll_s=0.1)
    assert agent.run() == 0
    assert (tmp_path / "trainer.exit").read_text().strip() == "0"
    assert "run finished; engines stopped" in capsys.readouterr().err
    assert all(_gone(r.popen.pid) for r in agent.running) and _gone(_grandchild(tmp_path))
