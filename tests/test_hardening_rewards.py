"""Issue 24 item 5: reward plug-ins are contained by the RewardPool.

A plug-in is arbitrary code; these run real plug-ins in real worker processes: one that starts a `sleep` and
leaves it running, one that calls a plain `os.fork()` (both processes return from the reward), one that writes
20 MB to stderr per call, one that maps twice its memory cap, one that returns 1e308 (finite in float64, inf in
float32). Nothing is faked. The `sleep`s are reaped by the test whatever happens (a fixture kills the pids left).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.procs import alive, gone_within
from mpo.rewards import RewardPool

MAX_OUTPUT_BYTES = 64 << 10  # mpo.rewards.pool.MAX_OUTPUT_BYTES (spelled out: the test predates it)

PLUGIN = textwrap.dedent("""
    import mmap
    import os
    import subprocess
    import sys

    def spawn(completion, answer, metadata):
        child = subprocess.Popen(["sleep", "600"])
        with open(metadata["pidfile"], "a") as f:
            f.write(f"{child.pid}\\n")
        return 1.0

    def fork(completion, answer, metadata):
        os.fork()  # no _exit in the child: it returns from the reward too
        return 1.0

    def chatty(completion, answer, metadata):
        sys.stderr.write("x" * (20 << 20))
        sys.stderr.flush()
        return 1.0

    def greedy(completion, answer, metadata):
        # Private anonymous pages count against RLIMIT_DATA; untouched, they cost no memory without the cap.
        m = mmap.mmap(-1, metadata["mb"] << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.close()
        return 1.0

    def huge(completion, answer, metadata):
        return 1e308 if completion == "huge" else 1.0
""")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    (root / "mpo_hardening_reward.py").write_text(PLUGIN)
    sys.path.insert(0, str(root))
    yield "mpo_hardening_reward"  # importable here and, through the pool's PYTHONPATH, in its workers
    sys.path.remove(str(root))
    sys.modules.pop("mpo_hardening_reward", None)


@pytest.fixture
def pidfile(tmp_path):
    path = tmp_path / "pids"
    yield path
    for line in path.read_text().split() if path.exists() else []:
        try:
            os.kill(int(line), signal.SIGKILL)  # only the sleeps this test started, by pid
        except ProcessLookupError:
            pass


def test_hardening_reward_grandchildren_die_with_the_pool(plugin, pidfile):
    pool = RewardPool(f"{plugin}:spawn", timeout_s=20, workers=1)
    rewards, errors = pool.score(["a", "b"], [0, 0], [{"pidfile": str(pidfile)}] * 2)
    assert (rewards, errors) == ([1.0, 1.0], 0)
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    pool.close()
    assert gone_within(pids, 3.0) == [], "processes a reward started outlived the pool"


def test_hardening_reward_grandchildren_die_when_the_trainer_is_killed(plugin, pidfile):
    """The pool's owner gets SIGKILL (no close): the worker dies of PR_SET_PDEATHSIG, its guard kills the group."""
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from mpo.rewards import RewardPool
        pool = RewardPool("{plugin}:spawn", timeout_s=20, workers=1)
        print(pool.score(["a"], [0], [{{"pidfile": {str(pidfile)!r}}}]), flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert owner.stdout.readline().strip() == "([1.0], 0)"
        pids = [int(p) for p in pidfile.read_text().split()]
        owner.kill()
        owner.wait()
        assert gone_within(pids, 3.0) == [], "a reward's child outlived the killed trainer"
    finally:
        owner.kill()
        owner.wait()


def test_hardening_reward_plain_fork_keeps_the_protocol(plugin):
    with RewardPool(f"{plugin}:fork", timeout_s=20, workers=2) as pool:
        for _ in range(2):
            rewards, errors = pool.score(["x"] * 6, [0] * 6, [{}] * 6)
            assert (rewards, errors) == ([1.0] * 6, 0), pool.last_errors


def test_hardening_reward_output_is_bounded(plugin, capfd):
    with RewardPool(f"{plugin}:chatty", timeout_s=20, workers=1) as pool:
        capfd.readouterr()
        rewards, errors = pool.score(["x"] * 3, [0] * 3, [{}] * 3)
        err = capfd.readouterr().err
        assert (rewards, errors) == ([1.0] * 3, 0), pool.last_errors
        assert len(err) <= MAX_OUTPUT_BYTES + 200, f"{len(err)} bytes of reward output reached stderr"
        assert "the rest of it is dropped" in err
        assert pool.dropped_output_bytes >= 3 * (20 << 20) - MAX_OUTPUT_BYTES


def test_hardening_reward_memory_is_capped(plugin):
    with RewardPool(f"{plugin}:greedy", timeout_s=20, workers=1, max_memory_mb=256) as pool:
        rewards, errors = pool.score(["x", "y"], [0, 0], [{"mb": 512}, {"mb": 16}])
        assert (rewards, errors) == ([0.0, 1.0], 1)
        assert "item 0: " in pool.last_errors[0] and ("MemoryError" in pool.last_errors[0]
                                                       or "Cannot allocate memory" in pool.last_errors[0])


def test_hardening_reward_finite_in_float64_but_not_float32_is_an_error(plugin):
    with RewardPool(f"{plugin}:huge", timeout_s=20, workers=1) as pool:
        rewards, errors = pool.score(["huge", "ok"], [0, 0], [{}, {}])
    assert (rewards, errors) == ([0.0, 1.0], 1)
    assert "not a finite float32" in pool.last_errors[0]
