"""Start, stop and restart an engine process on this machine (mpo's engine on CPU; SGLang uses the same shape)."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mpo.lifecycle import child_env
from mpo.parallel.ports import free_port
from mpo.rollout.client import EngineClient
from mpo.rollout.engine_command import API_KEY_ENV, EngineSettings, engine_command


# Variables torchrun sets for its workers. An engine started from a trainer rank must not inherit them: with
# TORCHELASTIC_USE_AGENT_STORE its own 1-rank process group would join the trainer's rendezvous and hang.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def engine_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    # An inherited MPO_API_KEY would give a keyless engine a key its clients do not know: only `extra` sets it.
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and k != API_KEY_ENV and not k.startswith("TORCHELASTIC_")}
    env.update(extra or {})
    return env


def _local_url(port: int) -> str:
    """Where a local engine serves: the loopback address `mpo_engine` gives its command as the host."""
    return f"http://127.0.0.1:{port}"


class LocalEngineProcess:
    """One engine server process: its own process group (so stop() takes its children too) and a log file."""

    PORT_RETRIES = 3  # start-ups that may move to another port because the picked one was taken meanwhile

    def __init__(self, command: list[str], *, port: int, log_path: Path, api_key: str | None = None,
                 startup_timeout_s: float = 300.0, env: dict[str, str] | None = None,
                 num_layers: int | None = None, topk: int | None = None, nice: int = 0) -> None:
        self.command, self.port, self.log_path, self.nice = command, port, Path(log_path), nice
        self.startup_timeout_s = startup_timeout_s
        self.env = engine_environment(env)
        self.client = EngineClient(_local_url(port), api_key=api_key, num_layers=num_layers, topk=topk)
        self.process: subprocess.Popen | None = None

    @classmethod
    def mpo_engine(cls, *, log_path: Path, settings: EngineSettings | None = None, port: int | None = None,
                   api_key: str | None = None, extra_args: list[str] = (), num_layers: int | None = None,
                   topk: int | None = None, nice: int = 0) -> "LocalEngineProcess":
        """mpo's engine on this host, with the command the launcher would give it (mpo.rollout.engine_command);
        `api_key` overrides the settings' key, `extra_args` are appended (argparse: the last value wins); `nice`
        lowers its CPU priority (os.setpriority) below the trainer ranks it shares the cores with."""
        settings = settings or EngineSettings()
        if api_key:
            settings = dataclasses.replace(settings, api_key=api_key)
        command = engine_command(settings, python=sys.executable, host="127.0.0.1", port=port or free_port())
        return cls([*command.argv, *extra_args], port=command.port, log_path=log_path, api_key=settings.api_key,
                   num_layers=num_layers, topk=topk, nice=nice,
                   env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **command.env})

    @property
    def url(self) -> str:
        return self.client.url

    def start(self) -> "LocalEngineProcess":
        return self.launch().wait_ready()

    def launch(self) -> "LocalEngineProcess":
        """Start the process without waiting for it to serve (wait_ready does): a run starts its engines while its
        ranks build their models."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # Own session: stop() signals the group. MPO_PARENT: the engine dies with this process (--exit-with-parent).
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**self.env, **child_env()}, start_new_session=True)
        if self.nice:  # its own process group (the new session): the engine and anything it starts
            os.setpriority(os.PRIO_PGRP, self.process.pid, self.nice)
        return self

    def wait_ready(self) -> "LocalEngineProcess":
        """Wait until the launched engine answers health checks (startup_timeout_s); stops it and raises if it exits
        or does not."""
        deadline = time.monotonic() + self.startup_timeout_s
        moves = 0
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if moves < self.PORT_RETRIES and self._port_was_taken():
                    moves += 1
                    self._move_to_a_free_port()
                    self.launch()
                    continue
                raise RuntimeError(f"engine on port {self.port} exited with {self.process.returncode} during "
                                   f"start-up; log: {self.log_path}\n{self.log_tail()}")
            if self.client.healthy(timeout_s=5.0):
                return self
            time.sleep(0.1)  # refused at once until it listens: a short poll, as start-up is on every run's path
        self.stop()
        raise RuntimeError(f"engine on port {self.port} not healthy after {self.startup_timeout_s} s; "
                           f"log: {self.log_path}\n{self.log_tail()}")

    def _port_was_taken(self) -> bool:
        """The engine exited because its port was taken between free_port() and its bind (another process's
        listener or outgoing connection got it first: a race, most likely on a busy host)."""
        return "--port" in self.command and os.strerror(errno.EADDRINUSE) in self.log_tail(60)

    def _move_to_a_free_port(self) -> None:
        """The same command on a newly picked port; the client (shared with whoever holds it) follows."""
        at = self.command.index("--port") + 1
        old, self.port = self.port, free_port()
        self.command = [*self.command[:at], str(self.port), *self.command[at + 1:]]
        self.client.url = _local_url(self.port)
        with open(self.log_path, "a") as log:
            log.write(f"mpo: port {old} was taken before the engine bound it; starting again on port {self.port}\n")

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def kill(self) -> None:
        """Hard crash (tests use it to simulate an engine dying mid-rollout)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> "LocalEngineProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
