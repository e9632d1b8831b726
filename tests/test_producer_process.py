"""mpo.trainer.producer: the off-policy rollout producer in a child process of rank 0 (off its GIL). Its link, without
engines or ranks: the child's rollout state round-trips (checkpoints), set_algorithm reaches it, close() ends it,
and a dead child is one line naming it, not a hang. tests/test_hardening_lifecycle.py runs it inside `mpo train`
(async mode: it collects every batch; a SIGKILL of it stops the run with that line; nothing is left behind)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mpo.config_checks import load_config
from mpo.rollout.client import EngineClient
from mpo.trainer.producer import ProducerDied, ProducerProcess


@pytest.fixture
def producer():
    config = load_config(None, ["schedule.mode=async", "data.retire_pass_rate=0.9"])
    client = EngineClient("http://127.0.0.1:9", num_layers=2, topk=2)  # routes are asked for: their shape is known
    made = ProducerProcess(config, [(client, None, None)], context_length=64)
    yield made
    made.close()


def test_the_child_owns_the_rollout_state_and_hears_set_algorithm(producer):
    assert producer.pid != os.getpid() and producer.process.is_alive()
    state = {"advantage_state": {}, "retirement": {"threshold": 0.9, "retired": ["a", "b"]}, "task": {}}
    producer.load_state_dict(state)
    assert producer.state_dict() == state
    config = load_config(None, ["schedule.mode=async", "data.retire_pass_rate=0.9", "algorithm.advantage=rloo"])
    producer.set_algorithm(config)
    assert producer.state_dict() == state  # the retirement and the data position are kept, as in the parent
    with pytest.raises(RuntimeError, match="^RolloutFailed: rollout: no healthy engine left; 64 of 64"):
        producer.collect(0, 0)  # no engine answers: the child's error comes back, one line
    producer.close()
    assert not producer.process.is_alive() and producer.process.exitcode == 0
    with pytest.raises(ProducerDied, match=f"pid {producer.pid}"):
        producer.state_dict()


def test_a_killed_child_is_one_line_naming_it(producer):
    producer.state_dict()  # up
    os.kill(producer.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(ProducerDied) as caught:
        producer.state_dict()
    assert time.monotonic() - started < 10
    assert str(caught.value) == (f"the rollout producer process (pid {producer.pid}) was killed by SIGKILL (its last "
                                 "lines are in the log above)")


def test_the_engines_stay_the_parents():
    """Whether an engine holds the current weights (and its restart) is asked of rank 0, which owns the engines."""
    asked = []
    config = load_config(None, ["schedule.mode=async"])
    made = ProducerProcess(config, [(EngineClient("http://127.0.0.1:9"), None, lambda: asked.append(os.getpid()))],
                           context_length=64)
    try:
        with pytest.raises(RuntimeError, match="^StaleEngines: .* waiting for the next weight sync"):
            made.collect(0, 0)
        assert asked and set(asked) == {os.getpid()}
    finally:
        made.close()
    assert made.process.exitcode == 0
