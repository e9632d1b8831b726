"""tests/helpers/spawn.py: ranks forked from the preloaded fork server behave as spawned ones towards the test that
starts them: they see its environment as it is now and write to its (captured) standard output and error, and a
rank's exception fails the call."""

from __future__ import annotations

import os
import sys

import pytest
from helpers.spawn import spawn_ranks


def _report(tag: str) -> None:
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} sees MPO_SPAWN_PROBE={os.environ.get(tag)}")
    print(f"rank {os.environ['RANK']} stderr line", file=sys.stderr)


def _fail() -> None:
    raise ValueError("rank failed on purpose")


@pytest.mark.parametrize("value", ["first", "second"])  # the second call reuses the server started by the first
def test_ranks_see_the_callers_environment_and_output(value, monkeypatch, capfd):
    monkeypatch.setenv("MPO_SPAWN_PROBE", value)
    spawn_ranks(2, _report, "MPO_SPAWN_PROBE")
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"rank {rank} of 2 sees MPO_SPAWN_PROBE={value}" in out
        assert f"rank {rank} stderr line" in err


def test_a_rank_exception_fails_the_call():
    with pytest.raises(Exception, match="rank failed on purpose"):
        spawn_ranks(1, _fail)
