"""Issue 47 items 3, 4 and 6: a reward or environment plug-in cannot hang, kill or bloat the run through its worker
pipe, leave a process behind with setsid(), or end the run with text the tokenizer cannot take.

Everything is real: plug-ins (written to a temporary module) run in the pools' real worker processes. A plug-in runs
inside the worker, so it can find the worker's protocol pipe in /proc/self/fd and write to it: that is how the
oversized and half-written frames are made, and the pool's own reading code meets them. The episodes run through
the real episode loop (mpo.envs.rollout) with a real tokenizer (helpers.tiny_tokenizer); only the engine is a
stand-in (a list of token ids per turn). Processes a test starts are reaped by pid whatever happens.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers.procs import alive, gone_within
from helpers.tiny_tokenizer import build_tiny_tokenizer
from mpo.envs.pool import EnvPool
from mpo.rewards import RewardPool
from mpo.rollout.protocol import GenerateResult, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODULE = "mpo_hardening_plugins"

PLUGIN = textwrap.dedent("""
    import os
    import pickle
    import struct
    import subprocess
    import time

    def _protocol_out():
        # The worker's answer pipe: a pipe's write end other than stderr's (fds 1 and 2 are stderr).
        stderr = os.readlink("/proc/self/fd/2")
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    flags = int(f.read().split("flags:")[1].split()[0], 8)
            except (OSError, IndexError):
                continue
            if fd > 2 and target.startswith("pipe:") and target != stderr and flags & 3 == os.O_WRONLY:
                return fd
        raise RuntimeError("no protocol pipe found")

    def huge_header(completion, answer, metadata):
        if completion == "bad":  # a frame header declaring 2^62 bytes, then the worker's own answer
            os.write(_protocol_out(), struct.pack("!Q", 1 << 62))
        return 1.0

    def trickle(completion, answer, metadata):
        if completion == "bad":  # a 1000-byte frame written a byte every 0.1 s: the frame takes 100 s
            fd = _protocol_out()
            os.write(fd, struct.pack("!Q", 1000))
            for _ in range(1000):
                os.write(fd, b"x")
                time.sleep(0.1)
        return 1.0

    def slow_first(completion, answer, metadata):
        if completion == "slow":  # item 0 fails after item 1 did
            time.sleep(1.0)
            raise ValueError("the slow one")
        if completion == "fast":
            raise ValueError("the fast one")
        return 1.0

    class _Opener:  # unpickles as open(path, "w"): a file created by whoever unpickles it
        def __init__(self, path):
            self.path = path

        def __reduce__(self):
            return (open, (self.path, "w"))

    def forged(completion, answer, metadata):
        if completion == "bad":  # a well-formed frame whose pickle calls a function when loaded
            body = pickle.dumps(_Opener(metadata["marker"]))
            os.write(_protocol_out(), struct.pack("!Q", len(body)) + body)
        return 1.0

    def _append(path, line):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{line}\\n".encode())
        os.close(fd)

    def escape(pidfile):
        # A child in a session of its own, and a daemon: double fork, setsid(), the middle process exits, so the
        # sleep is orphaned and in no process group of the worker's.
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        _append(pidfile, child.pid)
        middle = os.fork()
        if middle == 0:
            os.setsid()
            daemon = os.fork()
            if daemon == 0:
                os.execvp("sleep", ["sleep", "601"])
            _append(pidfile, daemon)
            os._exit(0)
        os.waitpid(middle, 0)

    def escaping(completion, answer, metadata):
        escape(metadata["pidfile"])
        _append(metadata["workerfile"], os.getpid())
        return 1.0

    class EscapingEnv:
        def __init__(self, row):
            self.pidfile = row["pidfile"]

        def reset(self):
            escape(self.pidfile)
            return [{"role": "user", "content": "q"}]

        def step(self, text):
            return [], 1.0, True

    class BigStateEnv:
        def __init__(self, row):
            self.blob = b"x" * (row["state_mb"] << 20)

        def reset(self):
            return [{"role": "user", "content": "q"}]

        def step(self, text):
            return [], 1.0, True

    class SurrogateEnv:
        # A lone surrogate (what json.loads makes of "\\\\ud800") in the opening, a role or an observation.
        def __init__(self, row):
            self.where = row["where"]

        def reset(self):
            if self.where == "role":
                return [{"role": "user\\udc80", "content": "q"}]
            return [{"role": "user", "content": "q \\ud800" if self.where == "reset" else "q"}]

        def step(self, text):
            if self.where == "step":
                return [{"role": "tool", "content": "RESULT \\udfff"}], 0.5, False
            return [], 1.0, True
""")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    (root / f"{MODULE}.py").write_text(PLUGIN)
    sys.path.insert(0, str(root))
    yield MODULE  # importable here and, through the pools' PYTHONPATH, in their workers
    sys.path.remove(str(root))
    sys.modules.pop(MODULE, None)


def _pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.fixture
def pidfile(tmp_path):
    path = tmp_path / "pids"
    yield path
    for pid in _pids(path):  # only the sleeps this test's plug-ins started, by pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- item 3: frames -----------------------------------------------------------------------------------------------


@pytest.fixture
def deadline():
    """Fail (instead of hanging the suite) a test still running after 30 s: today's blocking read never returns."""
    def expired(signum, frame):
        raise TimeoutError("the pool did not return within 30 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def test_hardening_plugin_frame_header_over_the_cap_is_one_counted_error(plugin, deadline):
    with RewardPool(f"{plugin}:huge_header", timeout_s=20, workers=1) as pool:
        rewards, errors = pool.score(["bad", "ok"], [0, 0], [{}, {}])
        assert (rewards, errors) == ([0.0, 1.0], 1), pool.last_errors
        assert "item 0: reward worker sent a frame of 4611686018427387904 bytes, over the cap" in pool.last_errors[0]
        assert pool.score(["ok"], [0], [{}]) == ([1.0], 0)  # the replaced worker scores


def test_hardening_plugin_half_written_frame_times_out_with_the_call(plugin, deadline):
    with RewardPool(f"{plugin}:trickle", timeout_s=1.0, workers=1) as pool:
        t0 = time.monotonic()
        rewards, errors = pool.score(["bad", "ok"], [0, 0], [{}, {}])
        took = time.monotonic() - t0
    assert (rewards, errors) == ([0.0, 1.0], 1), pool.last_errors
    assert "item 0: timed out after 1 s" in pool.last_errors[0]
    assert took < 10.0, f"the half-written frame held the pool {took:.1f} s (timeout_s=1)"


def test_hardening_plugin_errors_are_reported_in_input_order_not_finishing_order(plugin, deadline):
    """The log's "first" error is the batch's first item that failed, whichever worker finished first (CI: an env
    batch's first error came from item 1 in one run and item 0 in another)."""
    with RewardPool(f"{plugin}:slow_first", timeout_s=20, workers=2) as pool:
        rewards, errors = pool.score(["slow", "fast", "ok"], [0] * 3, [{}] * 3)
    assert (rewards, errors) == ([0.0, 0.0, 1.0], 2), pool.last_errors
    assert [m.split(":")[0] for m in pool.last_errors] == ["item 0", "item 1"], pool.last_errors
    assert "the slow one" in pool.last_errors[0], pool.last_errors


def test_hardening_plugin_frame_that_would_run_code_is_refused(plugin, tmp_path, deadline):
    """What the trainer unpickles from a worker is plain data: a frame naming a function is a counted error."""
    marker = tmp_path / "created_by_the_trainer"
    with RewardPool(f"{plugin}:forged", timeout_s=20, workers=1) as pool:
        rewards, errors = pool.score(["bad", "ok"], [0, 0], [{"marker": str(marker)}, {}])
    assert (rewards, errors) == ([0.0, 1.0], 1), pool.last_errors
    assert "item 0: reward worker sent an unreadable frame (UnpicklingError" in pool.last_errors[0]
    assert not marker.exists()


# -- item 4: containment beyond the process group -------------------------------------------------------------------


def _escaped(pool_score, pidfile: Path) -> list[int]:
    pool_score()
    pids = _pids(pidfile)
    assert len(pids) >= 2 and all(alive(p) for p in pids), pids
    return pids


def test_hardening_plugin_setsid_grandchildren_die_with_the_reward_pool(plugin, pidfile, tmp_path):
    pool = RewardPool(f"{plugin}:escaping", timeout_s=20, workers=1)
    meta = {"pidfile": str(pidfile), "workerfile": str(tmp_path / "worker")}
    pids = _escaped(lambda: pool.score(["a"], [0], [meta]), pidfile)
    pool.close()
    assert gone_within(pids, 3.0) == [], "a reward's setsid() child outlived the pool"


def test_hardening_plugin_setsid_grandchildren_die_with_a_killed_worker(plugin, pidfile, tmp_path):
    """The process running the reward gets SIGKILL (as from the OOM killer): what it started goes with it, and the
    pool goes on with a new worker."""
    workerfile = tmp_path / "worker"
    with RewardPool(f"{plugin}:escaping", timeout_s=20, workers=1) as pool:
        meta = {"pidfile": str(pidfile), "workerfile": str(workerfile)}
        pids = _escaped(lambda: pool.score(["a"], [0], [meta]), pidfile)
        (worker,) = _pids(workerfile)
        os.kill(worker, signal.SIGKILL)
        assert gone_within(pids, 3.0) == [], "a reward's setsid() child outlived its killed worker"
        pidfile.unlink()
        assert pool.score(["b"], [0], [meta]) == ([1.0], 0), pool.last_errors


def test_hardening_plugin_setsid_grandchildren_die_when_the_trainer_is_killed(plugin, pidfile, tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from mpo.rewards import RewardPool
        pool = RewardPool("{plugin}:escaping", timeout_s=20, workers=1)
        meta = {{"pidfile": {str(pidfile)!r}, "workerfile": {str(tmp_path / "worker")!r}}}
        print(pool.score(["a"], [0], [meta]), flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert owner.stdout.readline().strip() == "([1.0], 0)"
        pids = _pids(pidfile)
        assert len(pids) == 2
        owner.kill()
        owner.wait()
        assert gone_within(pids, 3.0) == [], "a reward's setsid() child outlived the killed trainer"
    finally:
        owner.kill()
        owner.wait()


def test_hardening_plugin_setsid_grandchildren_die_with_the_environment_pool(plugin, pidfile):
    pool = EnvPool(f"{plugin}:EscapingEnv", timeout_s=20, workers=2)
    batch = pool.reset([{"pidfile": str(pidfile)}] * 2)
    assert batch.errors == 0, pool.last_errors
    pids = _pids(pidfile)
    assert len(pids) == 4 and all(alive(p) for p in pids)
    pool.close()
    assert gone_within(pids, 3.0) == [], "an environment's setsid() child outlived the pool"


# -- items 3 and 6 through the episode loop: environment state and text ---------------------------------------------


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    from mpo.data.chat import PromptEncoder, load_tokenizer
    from mpo.envs.render import TurnRenderer

    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok")))
    return TurnRenderer(PromptEncoder(tokenizer), (tokenizer.convert_tokens_to_ids("<|im_end|>"),))


class _Prompt:
    def __init__(self, fields: dict) -> None:
        self.fields, self.source, self.ids, self.answer = fields, "rows.jsonl:1", (5, 6), None


def _engine(requests):
    """Stands in for the engines: every turn is the tokens [7, 8]."""
    return [GenerateResult(list(q.input_ids), [7, 8], [-0.5, -0.5], {"type": "stop"}) for q in requests], 0


def _run(pool, renderer, rows):
    from mpo.envs.rollout import run_episodes

    return run_episodes([_Prompt(r) for r in rows], 1, pool=pool, renderer=renderer, generate=_engine,
                        sampling=SamplingParams(max_new_tokens=8), seeds=list(range(len(rows))), max_turns=2,
                        context_length=512, want_routes=False)


def _peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident size, to the current one


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc/self/status")


def test_hardening_plugin_env_state_over_the_cap_is_an_episode_error(plugin, renderer, caplog):
    rows = [{"state_mb": 48}] * 4 + [{"state_mb": 0}] * 2
    with EnvPool(f"{plugin}:BigStateEnv", timeout_s=20, workers=2) as pool:  # the cap's default: 1 MiB
        _peak_rss_reset()
        before = _peak_rss_bytes()
        with caplog.at_level(logging.WARNING, logger="mpo.envs.rollout"):
            _, rewards, stats, _ = _run(pool, renderer, rows)
        grown = _peak_rss_bytes() - before
    assert rewards == [0.0] * 4 + [1.0] * 2 and stats.errors == 4
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"environment '{plugin}:BigStateEnv': 4 episode(s) failed" in lines[0], lines
    assert "over rollout.max_env_state_bytes=1048576" in lines[0], lines
    # four 48 MiB states held between turns would be 192 MiB here
    assert grown < 32 << 20, f"the trainer's peak memory grew by {grown >> 20} MiB"


def test_hardening_plugin_env_state_cap_comes_from_the_config():
    from mpo.config import RECIPES, ConfigError
    from mpo.config_checks import load_config

    config = load_config(RECIPES / "demo_cpu.yaml", ["rollout.max_env_state_bytes=4096"])
    assert config.rollout.max_env_state_bytes == 4096
    with pytest.raises(ConfigError, match=r"rollout.max_env_state_bytes=0; valid values: >= 1"):
        load_config(RECIPES / "demo_cpu.yaml", ["rollout.max_env_state_bytes=0"])


def test_hardening_plugin_env_lone_surrogate_is_an_episode_error(plugin, renderer, caplog):
    rows = [{"where": w} for w in ("reset", "role", "step", "none")]
    with EnvPool(f"{plugin}:SurrogateEnv", timeout_s=20, workers=2) as pool:
        with caplog.at_level(logging.WARNING, logger="mpo.envs.rollout"):
            results, rewards, stats, _ = _run(pool, renderer, rows)
        messages = list(pool.last_errors)
    assert stats.errors == 3 and [r.meta["env_error"] for r in results] == [True] * 3 + [False]
    assert rewards == [0.0] * 3 + [1.0]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"environment '{plugin}:SurrogateEnv': 3 episode(s) failed" in lines[0], lines
    assert "reset(): key [0] 'content' is not valid UTF-8 text (surrogates not allowed" in lines[0], lines
    assert any("step(): key [0] 'content' is not valid UTF-8 text" in m for m in messages), messages
