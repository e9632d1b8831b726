"""Runs one node's part of a plan: starts its processes, watches them, and tears everything down on failure.

One agent runs per node (under SLURM: `srun --ntasks-per-node=1 --kill-on-bad-exit=1 python -m launch ...`). An
agent knows only its own node; failures cross nodes like this:
- a process of this node fails -> this agent stops all its processes and exits non-zero, naming the part and its
  log; srun's --kill-on-bad-exit then sends SIGTERM to the other agents, which stop theirs the same way;
- the trainer's ranks on other nodes also notice through torchrun/gloo/NCCL (a dead peer ends the collective).
Engines outlive the trainer on their node until trainer node 0 writes the done marker (its exit code), because rank
0 pushes the final weights to every engine after the other ranks may already have exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launch.plan import NodePlan, Plan, Process
from mpo.lifecycle import preexec_exit_with_this_process


class Stopped(Exception):
    """The agent got SIGTERM/SIGINT (srun does this when another node's part failed, or on scancel)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Running:
    """A started process of this node."""

    spec: Process
    popen: subprocess.Popen


def say(node: NodePlan, message: str) -> None:
    print(f"launch: node {node.node_rank} ({node.host}): {message}", file=sys.stderr, flush=True)


def log_tail(path: str, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "    (no log)"
    return "\n".join("    | " + line for line in text)


def process_env(spec: Process) -> dict[str, str]:
    """The environment `spec` runs in: the agent's, the plan's on top. A trainer of several ranks a node gets
    OMP_NUM_THREADS=1 unless set: what torchrun sets then anyway, without the banner it prints at the top of the
    trainer's log when it has to (megatron's notices are filtered in the ranks themselves: mpo.quiet)."""
    env = {**os.environ, **spec.env}
    if spec.kind == "trainer" and "--nproc-per-node" in spec.argv[:-1]:
        per_node = spec.argv[spec.argv.index("--nproc-per-node") + 1]
        if per_node.isdigit() and int(per_node) > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Agent:
    """This node's part of `plan`.

    Attributes:
        plan: the whole run (every agent computes the same one).
        node_rank: which node this agent is.
        engine_timeout_s: how long trainer nodes wait for every engine to answer /health_generate.
        linger_timeout_s: how long engines wait for the done marker after this node's trainer finished (and how long
            a node without a trainer waits at most once the trainer is gone... it waits for the marker).
        poll_s: how often processes are checked.
    """

    def __init__(self, plan: Plan, node_rank: int, *, engine_timeout_s: float = 1800.0,
                 linger_timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        self.plan = plan
        self.node = plan.nodes[node_rank]
        self.engine_timeout_s = engine_timeout_s
        self.linger_timeout_s = linger_timeout_s
        self.poll_s = poll_s
        self.running: list[Running] = []
        self.started_at = time.time()

    # -- process control ---------------------------------------------------------------------------------------------
    def _start(self, spec: Process) -> Running:
        Path(spec.log).parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log, "ab") as log:
            # Own session: teardown signals the whole process group (torchrun's workers, SGLang's schedulers). The
            # death signal: a SIGKILLed agent runs no teardown, yet its processes must not outlive it.
            popen = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=process_env(spec), start_new_session=True,
                                     preexec_fn=preexec_exit_with_this_process())
        say(self.node, f"started {spec.name} (pid {popen.pid}); log: {spec.log}")
        running = Running(spec, popen)
        self.running.append(running)
        return running

    def teardown(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process group this agent started, SIGKILL what is left after `grace_s`."""
        for s in (signal.SIGTERM, signal.SIGINT):  # a second signal must not interrupt the teardown itself
            signal.signal(s, signal.SIG_IGN)
        live = [r for r in self.running if r.popen.poll() is None]
        for r in self.running:
            # Also the groups of leaders that already died: their children (SGLang schedulers...) may live on.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for r in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.popen.wait(max(0.0, deadline - time.monotonic()))
        for r in self.running:
            # Children of an exited leader may still run in its group: kill the group regardless.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.popen.pid, signal.SIGKILL)
            r.popen.wait()

    # -- run markers -------------------------------------------------------------------------------------------------
    def _write_marker(self, code: int) -> None:
        path = Path(self.plan.done_marker)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}")
        tmp.write_text(f"{code}\n")
        os.replace(tmp, path)

    def _read_marker(self) -> int | None:
        path = Path(self.plan.done_marker)
        try:
            # A marker older than this agent belongs to an earlier run with the same id.
            if path.stat().st_mtime < self.started_at - 5:
                return None
            return int(path.read_text().strip() or 1)
        except (OSError, ValueError):
            return None

    def _write_config(self) -> None:
        path = Path(self.plan.resolved_config_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.node{self.node.node_rank}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold rollout.api_key
        with os.fdopen(fd, "w") as f:
            f.write(self.plan.resolved_config)
        os.replace(tmp, path)  # every trainer node writes the same text; the rename keeps readers whole

    # -- main loop ---------------------------------------------------------------------------------------------------
    def _check(self, trainer_running: bool) -> None:
        """Raise RuntimeError naming the part if a process of this node died when it should not have."""
        for r in self.running:
            code = r.popen.poll()
            if code is None:
                continue
            if r.spec.kind == "trainer" and code == 0:
                continue
            if r.spec.kind == "engine" and not trainer_running and code in (0, -signal.SIGTERM):
                continue
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            raise PartFailed(r, f"{r.spec.name} {how}")

    def _wait_for_engines(self) -> None:
        from mpo.rollout.client import EngineClient

        pending = list(self.plan.engine_urls) if self.plan.placement != "external" else []
        if not pending:
            return
        api_key = _api_key(self.plan)
        say(self.node, f"waiting for {len(pending)} engine(s) to answer: {', '.join(pending)}")
        deadline = time.monotonic() + self.engine_timeout_s
        while pending:
            self._check(trainer_running=True)
            pending = [u for u in pending if not EngineClient(u, api_key=api_key).healthy(timeout_s=5.0)]
            if not pending:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines not healthy after {self.engine_timeout_s:.0f} s: {', '.join(pending)} "
                                   f"(their logs are in {self.plan.run_dir}/node*/)")
            time.sleep(1.0)
        say(self.node, "all engines healthy")

    def run(self) -> int:
        """Run this node's part to the end; returns the agent's exit code (0: the run succeeded)."""
        previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGINT)}
        node = self.node
        trainer_spec = next((p for p in node.processes if p.kind == "trainer"), None)
        is_rank0_node = node.node_rank == 0 and trainer_spec is not None
        try:
            say(node, f"role {node.role}; {len(node.processes)} process(es); logs in {node.log_dir}")
            if is_rank0_node:
                Path(self.plan.done_marker).unlink(missing_ok=True)
            for spec in node.processes:
                if spec.kind == "engine":
                    self._start(spec)
            trainer = None
            if trainer_spec is not None:
                self._write_config()
                self._wait_for_engines()
                trainer = self._start(trainer_spec)
            linger_deadline = None
            while True:
                trainer_running = trainer is not None and trainer.popen.poll() is None
                self._check(trainer_running)
                if trainer is not None and not trainer_running and trainer.popen.returncode == 0:
                    if is_rank0_node and self._read_marker() is None:
                        self._write_marker(0)
                        say(node, "trainer finished (exit 0)")
                    if not any(p.kind == "engine" for p in node.processes):
                        return 0
                    if linger_deadline is None:
                        linger_deadline = time.monotonic() + self.linger_timeout_s
                if trainer is None or not trainer_running:
                    code = self._read_marker()
                    if code is not None:
                        self.teardown()
                        if code != 0:
                            say(node, f"trainer node 0 reported exit code {code}; stopped this node's processes")
                            return 1
                        say(node, "run finished; engines stopped")
                        return 0
                    if linger_deadline is not None and time.monotonic() > linger_deadline:
                        self.teardown()
                        say(node, f"no done marker from trainer node 0 after {self.linger_timeout_s:.0f} s "
                                  f"({self.plan.done_marker}); engines stopped")
                        return 1
                time.sleep(self.poll_s)
        except PartFailed as exc:
            say(node, f"FAILED: {exc.message}; log: {exc.running.spec.log}\n{log_tail(exc.running.spec.log)}")
            self.teardown()
            if is_rank0_node:
                self._write_marker(exc.code)
            say(node, "stopped every process of this node")
            return exc.code
        except Stopped as exc:
            say(node, f"received {exc}: stopping {sum(r.popen.poll() is None for r in self.running)} process(es)")
            self.teardown()
            return 128 + exc.signum
        except BaseException as exc:
            say(node, f"FAILED: {type(exc).__name__}: {exc}")
            self.teardown()
            if is_rank0_node:
                self._write_marker(1)
            return 1
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class PartFailed(Exception):
    def __init__(self, running: Running, message: str) -> None:
        super().__init__(message)
        self.running, self.message = running, message
        code = running.popen.returncode
        self.code = code if code and code > 0 else 1


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def _api_key(plan: Plan) -> str | None:
    import yaml

    return (yaml.safe_load(plan.resolved_config).get("rollout") or {}).get("api_key")
