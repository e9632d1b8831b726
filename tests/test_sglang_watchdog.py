"""The SGLang harness's start-up (tests/helpers/sglang_server.py).

The watchdog: a test run killed by a timeout (SIGKILL: no fixture teardown) left its SGLang server running,
re-parented to init, a core busy for the rest of the session. Servers are now watched and die with the process that
started them.

A taken port: with two pytest workers, the port free_port() picked was once taken before SGLang bound it (CI: four
tests of test_real_task_e2e errored with "exited with -9"). SGLang does not exit then: uvicorn logs "[Errno 98] ...
address already in use" and the warm-up thread kills the process 120 s later. launch_server now reads that line and
starts the server again on another port.

Real processes and sockets throughout; the stand-ins: the watched "server" is a process group of `sleep`s, and the
server on a taken port is a small Python HTTP server that behaves as SGLang does on a taken port (logs uvicorn's
line and lives on), because a real SGLang start-up takes a minute (the real servers of the suite go through the same
launch_server; a real SGLang 0.5.23 on a held port logged that line and, moved by the harness, served 77 s later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers.procs import alive, gone_within
from helpers.sglang_server import launch_server

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


# SGLang's behaviour on a taken port, in small: uvicorn's error line, then the process lives on (SGLang's warm-up
# thread would kill it 120 s later); on a free port, /health_generate answers 200.
_STAND_IN_SERVER = """
import http.server, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as exc:
    print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    time.sleep(600)
    sys.exit(1)
print(f"serving on {port}", flush=True)
server.serve_forever()
"""


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "server.log"
        server = launch_server([sys.executable, "-c", _STAND_IN_SERVER, "--port", str(port)], dict(os.environ),
                               port=port, log_path=log, cwd=tmp_path, api_key=None, ready_timeout=60.0)
        try:
            moved_to = int(server.url.rsplit(":", 1)[1])
            assert moved_to != port and server.start_seconds < 30, (server.url, server.start_seconds)
            text = log.read_text()
            assert f"harness: port {port} was taken" in text and f"serving on {moved_to}" in text, text
        finally:
            server.stop()
