"""Start and stop a REAL sglang HTTP server (from `.venv-sglang`) on a CPU-only machine, for tests.

Tests run in the main venv, which has no sglang; the server runs in the separate `.venv-sglang` made by
`tests/sglang_harness/setup.sh`. The server is the unmodified sglang 0.5.23. The only fakes are in
`tests/sglang_harness/` (put first on the server's PYTHONPATH): a stand-in `sgl_kernel` (sglang has no CPU kernel
build on PyPI) and a `sitecustomize.py` import hook that skips CUDA host-memory pinning. See their docstrings.

Usage:
    with start_sglang_server(model_dir, api_key="k") as server:
        requests.post(server.url + "/generate", json={...})
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path

from helpers.tiers import tier_unavailable
from mpo.parallel.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESS_DIR = REPO_ROOT / "tests" / "sglang_harness"
SGLANG_VERSION = "0.5.23"
PORT_RETRIES = 3  # start-ups that may move to another port because the picked one was taken meanwhile


def sglang_venv() -> Path:
    """The sglang venv: $MPO_SGLANG_VENV if set, else `<repo>/.venv-sglang`."""
    return Path(os.environ.get("MPO_SGLANG_VENV", REPO_ROOT / ".venv-sglang"))


def sglang_python() -> Path:
    return sglang_venv() / "bin" / "python"


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for sglang processes: CPU engine on, harness first on PYTHONPATH, offline hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=str(HARNESS_DIR),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


@lru_cache(maxsize=1)
def sglang_available() -> tuple[bool, str]:
    """(True, version) when `.venv-sglang` exists and imports sglang with the harness; else (False, reason)."""
    py = sglang_python()
    if not py.exists():
        return False, f"{py} not found; run `bash tests/sglang_harness/setup.sh`"
    try:
        out = subprocess.run(
            [str(py), "-c", "import sglang, sgl_kernel; print(sglang.__version__)"],
            env=server_env(), capture_output=True, text=True, timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"running {py} failed: {exc}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, f"`import sglang` failed in {py}: {last}"
    version = out.stdout.strip().splitlines()[-1]
    if version != SGLANG_VERSION:
        return False, f"{py} has sglang {version}, the harness is written for {SGLANG_VERSION}"
    return True, version


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class PortTaken(RuntimeError):
    """The server could not bind its HTTP port: another process took it after free_port() reported it free."""


class SGLangServer:
    """A running server process (own session / process group). Context manager; `.stop()` is idempotent."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, api_key: str | None,
                 log_start: int = 0) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.api_key = api_key
        self.log_start = log_start  # the log's size when this process started: what it wrote begins there
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 60) -> str:
        return _tail(self.log_path, n)

    def port_was_taken(self) -> bool:
        """uvicorn failed to bind the port ("[Errno 98] ... address already in use"). SGLang does not exit then: its
        warm-up thread keeps the process alive for 120 s and then kills it (-9), so this is read from the log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return False
        return "address already in use" in text.lower()

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Poll /health_generate until 200; raise PortTaken when the port could not be bound, RuntimeError with the
        log tail on exit or timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.port_was_taken():
                raise PortTaken(f"port {self.url.rsplit(':', 1)[1]} was taken before the server bound it")
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"sglang server exited with {self.proc.returncode} while starting; log {self.log_path}:\n"
                    + self.log_tail()
                )
            req = urllib.request.Request(self.url + "/health_generate", headers=self.headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    if resp.status == 200:
                        self.start_seconds = time.monotonic() - t0
                        return self.start_seconds
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"sglang server not ready after {timeout:.0f} s; log {self.log_path}:\n" + self.log_tail())

    def stop(self, timeout: float = 30.0) -> float:
        """SIGTERM the server's own process group (it leads it), wait, then SIGKILL the group if needed.
        Returns the seconds it took (0 if it was already gone)."""
        if self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return 0.0
        t0 = time.monotonic()
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(self.proc.pid):
                    break
                time.sleep(0.2)
            else:
                continue
            break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.stop_seconds = time.monotonic() - t0
        return self.stop_seconds

    def __enter__(self) -> "SGLangServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def start_sglang_server(
    model_dir: Path,
    *,
    port: int | None = None,
    dtype: str = "fp32",
    fp32_lm_head: bool = False,
    api_key: str | None = None,
    log_path: Path | None = None,
    extra_args: list[str] | None = None,
    ready_timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> SGLangServer:
    """Start SGLang from `.venv-sglang` with the launcher's own engine command (mpo.rollout.engine_command: routed
    experts on, the key in MPO_API_KEY rather than argv) plus the flags a CPU needs, and wait until it generates."""
    from mpo.rollout.engine_command import EngineSettings, engine_command

    ok, reason = sglang_available()
    if not ok:
        raise RuntimeError(f"sglang is not available: {reason}")
    port = port or free_port()
    log_path = Path(log_path or Path(model_dir) / f"sglang-server-{port}.log")
    command = engine_command(EngineSettings(engine="sglang", hf_dir=str(model_dir), dtype=dtype,
                                            fp32_lm_head=fp32_lm_head, api_key=api_key),
                             python=str(sglang_python()), host="127.0.0.1", port=port)
    cmd = [
        *command.argv,
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch",
        "--disable-overlap-schedule",
        "--max-total-tokens", "4096",
        # SGLang's scheduler polls its sockets without blocking: idle, it holds a whole core (30 CPU-s in 30 s,
        # measured), taken from everything else on these 2 cores for as long as a module keeps its server. With
        # this, an idle scheduler waits in zmq's poll (up to 1 s, woken at once by a request).
        "--sleep-on-idle",
        *(extra_args or []),
    ]
    return launch_server(cmd, server_env({**command.env, **(env or {})}), port=port, log_path=log_path, cwd=Path(model_dir),
                         api_key=api_key, ready_timeout=ready_timeout)


# The watchdog's whole program (no imports beyond the standard library: it starts in ~20 ms). It polls once a second
# whether its parent (the test process) is still its parent; once it is re-parented (the test process died, even by
# SIGKILL, when no teardown runs), it ends the server's process group: SIGTERM, then SIGKILL after 20 s. It exits on
# its own when the group is gone (a normal stop()).
_WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
def alive():
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while alive():
    if os.getppid() != parent:
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and alive():
                time.sleep(0.5)
        break
    time.sleep(1.0)
"""


def watch_for_parent_death(group: int) -> subprocess.Popen:
    """A watchdog that ends process group `group` when this process dies: a test run killed by a timeout (SIGKILL,
    no fixture teardown) must not leave a server spinning a core for the rest of the session. The watchdog has its
    own session, so a signal to the test's process group does not take it down with its parent."""
    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(group)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def launch_server(cmd: list[str], env: dict[str, str], *, port: int, log_path: Path, cwd: Path,
                  api_key: str | None, ready_timeout: float) -> SGLangServer:
    """Start a server command in its own session (stop() takes its children), watched so that it dies with this
    process (watch_for_parent_death), logging to `log_path`, and wait until it generates on 127.0.0.1:`port`; a server
    that never gets ready is stopped before the error propagates. A port taken between free_port() and the server's
    bind (another process's listener or outgoing connection, likely with two pytest workers) moves the server to a
    newly picked port, PORT_RETRIES times at most, as the launcher's engines do (mpo.rollout.local_engine)."""
    moves = 0
    while True:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:  # the child holds its own descriptor
            log_start = log.tell()
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(cwd))
        watch_for_parent_death(proc.pid)
        server = SGLangServer(proc, f"http://127.0.0.1:{port}", log_path, api_key, log_start)
        try:
            server.wait_ready(ready_timeout)
            return server
        except PortTaken:
            server.stop()
            if moves == PORT_RETRIES or "--port" not in cmd:
                raise
            moves += 1
            old, port = port, free_port()
            at = cmd.index("--port") + 1
            cmd = [*cmd[:at], str(port), *cmd[at + 1:]]
            with open(log_path, "a") as log:
                log.write(f"harness: port {old} was taken before the server bound it; starting again on {port}\n")
        except BaseException:
            server.stop()
            raise



def serve_module(request, model_dir: Path, api_key: str | None = None, **options):
    """Body of a module-scoped `server` fixture: one real server for the module; without SGLang a loud skip, or a
    failure in CI. `options` go to start_sglang_server (extra_args, env)."""
    ok, reason = sglang_available()
    if not ok:
        tier_unavailable("SGLANG", reason, request)
    with start_sglang_server(model_dir, log_path=model_dir / "server.log", api_key=api_key, **options) as srv:
        print(f"\n[sglang] server ready in {srv.start_seconds:.1f} s at {srv.url} (log {srv.log_path})", file=sys.stderr)
        yield srv
    print(f"\n[sglang] server stopped in {srv.stop_seconds:.1f} s", file=sys.stderr)
