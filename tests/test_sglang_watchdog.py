"""The SGLang harness's watchdog (tests/helpers/sglang_server.py): a test run killed by a timeout (SIGKILL: no fixture
teardown) left its SGLang server running, re-parented to init, a core busy for the rest of the session. Servers are
now watched and die with the process that started them.

Real processes throughout; the one stand-in: the "server" is a process group of `sleep`s in its own session, started
and watched exactly as launch_server does, because a real SGLang start-up takes a minute (the real servers of the
suite go through the same launch_server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers.procs import alive, gone_within

TESTS = Path(__file__).resolve().parent

_TEST_PROCESS = f"""
import subprocess, sys, time
sys.path.insert(0, {str(TESTS)!r})
from helpers.sglang_server import watch_for_parent_death
server = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600"], start_new_session=True)
watchdog = watch_for_parent_death(server.pid)
time.sleep(0.5)
print(server.pid, watchdog.pid, flush=True)
time.sleep(600)
"""


def _group(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid` (from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                members.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return [p for p in members if alive(p)]


def test_sglang_watchdog_ends_the_server_group_when_the_test_process_is_sigkilled():
    test_process = subprocess.Popen([sys.executable, "-c", _TEST_PROCESS], stdout=subprocess.PIPE, text=True)
    server, watchdog = (int(x) for x in test_process.stdout.readline().split())
    members = _group(server)
    try:
        assert len(members) == 3, f"the stand-in server's group should hold sh and two sleeps, got {members}"
        test_process.kill()  # what a timeout does: no teardown runs
        test_process.wait()
        left = gone_within([*members, watchdog], 30.0)  # polled each second, then SIGTERM
        assert not left, f"still alive 30 s after the test process was SIGKILLed: {left} (server group {server})"
    finally:
        test_process.kill()
        try:
            os.killpg(server, signal.SIGKILL)
        except ProcessLookupError:
            pass
