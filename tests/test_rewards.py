"""Reward registry, the built-in rewards (real math-verify and reasoning-gym), plug-ins, the process pool with
raising / hanging / crashing rewards, and DAPO's overlong penalty against hand-computed values."""
from __future__ import annotations

import sys
import textwrap
import time

import pytest

from mpo.data.sources import open_source
from mpo.rewards import RewardPool, get_reward, overlong_penalty, register_reward, reward_names

PLUGIN = textwrap.dedent("""
    import os
    import time

    def flaky(completion, answer, metadata):
        if completion == "hang":
            while True:
                time.sleep(0.05)
        if completion == "raise":
            raise RuntimeError("boom")
        if completion == "crash":
            os._exit(3)
        if completion == "nan":
            return float("nan")
        print("a reward that prints must not break the pool")
        return float(completion.strip() == str(answer)) + metadata.get("bonus", 0.0)

    NOT_A_FUNCTION = 3
""")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "mpo_test_reward_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mpo_test_reward_plugin"
    sys.modules.pop("mpo_test_reward_plugin", None)


def test_registry_names_and_errors(plugin):
    assert {"math", "reasoning_gym", "toy"} <= set(reward_names())
    with pytest.raises(ValueError) as info:
        get_reward("maths")
    assert str(info.value).startswith("unknown reward 'maths'; known rewards: math, reasoning_gym, toy")
    fn = get_reward(f"{plugin}:flaky")
    assert fn("7", 7, {"bonus": 0.5}) == 1.5
    with pytest.raises(ValueError) as info:
        get_reward("no_such_module_xyz:fn")
    assert str(info.value) == ("reward 'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz': "
                               "No module named 'no_such_module_xyz'")
    with pytest.raises(ValueError) as info:
        get_reward(f"{plugin}:missing")
    assert str(info.value) == f"reward '{plugin}:missing': module '{plugin}' has no attribute 'missing'"
    with pytest.raises(ValueError) as info:
        get_reward(f"{plugin}:NOT_A_FUNCTION")
    assert str(info.value) == f"reward '{plugin}:NOT_A_FUNCTION': 'NOT_A_FUNCTION' is a int, not a function"
    with pytest.raises(ValueError, match="already registered"):
        register_reward("toy")(lambda c, a, m: 0.0)


@pytest.mark.parametrize("answer, completion, expected", [
    ("\\frac{1}{2}", "So the probability is 0.5.", 1.0),
    ("0.5", "We get $\\frac{1}{2}$, i.e. \\boxed{\\frac{1}{2}}", 1.0),
    (42, "12 + 30 = 42, so the answer is \\boxed{42}.", 1.0),
    (0.25, "\\boxed{1/4}", 1.0),
    ("\\boxed{x^2+1}", "\\boxed{1 + x^2}", 1.0),
    ("\\sqrt{2}", "the side is \\boxed{\\sqrt 2}", 1.0),
    ("x<2", "so x lies in \\boxed{(-\\infty, 2)}", 1.0),  # only verify(gold, prediction) accepts this order
    (42, "12 + 30 = 42? No: \\boxed{41}", 0.0),  # the boxed answer wins over an earlier number
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ("3", "I do not know", 0.0),
])
def test_math_reward(answer, completion, expected):
    assert get_reward("math")(completion, answer, {}) == expected


def test_reasoning_gym_reward_uses_the_task_scorer():
    reward = get_reward("reasoning_gym")
    source = open_source("reasoning_gym:basic_arithmetic?size=3&seed=7")
    for i in range(len(source)):
        row = source.row(i)
        expression = row.metadata["reasoning_gym"]["metadata"]["expression"]
        value = round(eval(expression))  # independent reference: Python evaluates the same expression
        assert reward(f"Let me compute. <answer>{value}</answer>", row.answer, row.metadata) == 1.0
        assert reward(f"<answer>{value + 1}</answer>", row.answer, row.metadata) == 0.0
    row = open_source("reasoning_gym:spell_backward?size=2&seed=3").row(1)
    word = row.metadata["reasoning_gym"]["metadata"]["word"]
    assert reward(f"  {word[::-1]} ", row.answer, row.metadata) == 1.0  # no tag: the whole stripped completion
    assert reward(word, row.answer, row.metadata) == 0.0
    with pytest.raises(ValueError, match=r"needs metadata\['reasoning_gym'\]"):
        reward("1", "1", {})


def test_toy_reward():
    toy = get_reward("toy")
    assert toy(" 321\n", 321, {}) == 1.0 and toy("32", "321", {}) == 0.0


def test_reward_pool_survives_raising_hanging_and_crashing_rewards(plugin):
    completions = ["1", "raise", "hang", "2", "crash", "nan", "x", "4"]
    answers = ["1", "1", "1", "3", "1", "1", "x", "4"]
    metadatas = [{}, {}, {}, {}, {}, {}, {"bonus": 0.25}, {}]
    with RewardPool(f"{plugin}:flaky", timeout_s=1.0, workers=2) as pool:
        start = time.monotonic()
        rewards, errors = pool.score(completions, answers, metadatas)
        assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.25, 1.0]
        assert errors == 4  # raise, hang (timed out), crash, nan
        assert time.monotonic() - start < 20
        messages = " | ".join(sorted(pool.last_errors))
        assert "item 1: RuntimeError: boom" in messages and "item 2: timed out after 1 s" in messages
        assert "item 4: reward worker died (exit code 3)" in messages and "item 5: ValueError: reward is nan" in messages
        # The killed and crashed workers were replaced: the next batch scores normally, in order.
        assert pool.score(["a", "b", "c"], ["a", "x", "c"], [{}, {}, {}]) == ([1.0, 0.0, 1.0], 0)
        assert pool.score([], [], []) == ([], 0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["a"], ["a"], [{}])


def test_reward_pool_rejects_bad_arguments(plugin):
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        RewardPool("nope", timeout_s=1, workers=1)
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        RewardPool("toy", timeout_s=0, workers=1)
    with RewardPool("toy", timeout_s=5, workers=1) as pool:
        with pytest.raises(ValueError, match="2 completions, 1 answers, 2 metadatas"):
            pool.score(["a", "b"], ["a"], [{}, {}])


@pytest.mark.parametrize("length, max_len, buffer, expected", [
    # DAPO's soft overlong punishment: 0 if |y| <= Lmax - Lcache, ((Lmax - Lcache) - |y|) / Lcache inside, -1 beyond.
    (16, 20, 4, 0.0),
    (0, 20, 4, 0.0),
    (17, 20, 4, -0.25),  # (16 - 17) / 4
    (18, 20, 4, -0.5),
    (20, 20, 4, -1.0),
    (21, 20, 4, -1.0),
    (16384, 20480, 4096, 0.0),  # DAPO's Lmax 20480, Lcache 4096
    (18432, 20480, 4096, -0.5),  # (16384 - 18432) / 4096
    (19456, 20480, 4096, -0.75),
    (30000, 20480, 4096, -1.0),
])
def test_overlong_penalty(length, max_len, buffer, expected):
    assert overlong_penalty(length, max_len, buffer) == expected


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer=0 must be in 1..max_len"):
        overlong_penalty(5, 10, 0)
