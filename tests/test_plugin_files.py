"""Plug-ins named by a file (`path/to/file.py:attr`) and plug-in modules beside the user, without PYTHONPATH.

Real reward workers (mpo.rewards.RewardPool's processes) load the file; the real `mpo` console script checks a
config naming a module in its current directory, as a user types it. Nothing is faked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.tiny_tokenizer import build_tiny_tokenizer
from mpo.envs.registry import get_env_class
from mpo.plugins import resolve_plugin
from mpo.rewards import RewardPool, get_reward

RECIPE = Path(__file__).resolve().parents[1] / "mpo" / "recipes" / "demo_cpu.yaml"
REWARD = textwrap.dedent("""
    def exact(completion, answer, metadata):
        return float(completion.strip() == str(answer))
""")
ENV = textwrap.dedent("""
    class Echo:
        def reset(self, row):
            return [{"role": "user", "content": "say hi"}]

        def step(self, text):
            return [], float(text == "hi"), True
""")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's working directory holding their plug-in files, as the current directory."""
    (tmp_path / "my_reward.py").write_text(REWARD)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "echo_env.py").write_text(ENV)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_plugin_reward_from_a_relative_file_scores_in_the_worker_processes(user_dir):
    fn = get_reward("my_reward.py:exact")
    assert fn("4", 4, {}) == 1.0
    with RewardPool("./my_reward.py:exact", timeout_s=5.0, workers=2) as pool:
        rewards, errors = pool.score(["4", "5", " 7 "], [4, 4, 7], [{}, {}, {}])
    assert (rewards, errors) == ([1.0, 0.0, 1.0], 0)


def test_plugin_environment_from_a_file_path(user_dir):
    cls = get_env_class(f"{user_dir / 'envs' / 'echo_env.py'}:Echo")
    assert cls().step("hi") == ([], 1.0, True)
    assert get_env_class("envs/echo_env.py:Echo") is cls  # the same file is one module however it is named


@pytest.mark.parametrize("target, message", [
    ("nope.py:exact", "reward 'nope.py:exact': no Python file "),
    ("my_reward.py:missing", "reward 'my_reward.py:missing': module 'my_reward.py' has no attribute 'missing'"),
    ("broken.py:fn", "reward 'broken.py:fn': "),
])
def test_plugin_file_errors_are_one_line(user_dir, target, message):
    (user_dir / "broken.py").write_text("raise RuntimeError('the plug-in itself fails')\n")
    with pytest.raises(ValueError) as info:
        resolve_plugin("reward", target, target)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    if target.startswith("broken"):
        assert "RuntimeError: the plug-in itself fails" in str(info.value)


def test_plugin_module_beside_the_user_needs_no_pythonpath(user_dir):
    """`reward.fn=my_reward:exact` from the directory holding my_reward.py, with the installed `mpo` command (whose
    sys.path, unlike `python -m`'s, does not hold the current directory)."""
    mpo = Path(sys.executable).with_name("mpo")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if "PYTHONPATH" in os.environ:  # a worktree's checkout first, as the caller had it; the user's dir still absent
        env["PYTHONPATH"] = os.pathsep.join(p for p in os.environ["PYTHONPATH"].split(os.pathsep)
                                            if p and Path(p).resolve() != user_dir.resolve())
    (user_dir / "x.jsonl").write_text('{"prompt": "1+1?", "answer": 2}\n')
    tokenizer = build_tiny_tokenizer(user_dir / "tok")
    result = subprocess.run([str(mpo), "check-config", "--config", str(RECIPE), "data.task=x.jsonl",
                             f"model.tokenizer_dir={tokenizer}", "reward.fn=my_reward:exact"], capture_output=True,
                            text=True, env=env, cwd=user_dir, timeout=120)
    assert result.returncode == 0 and "cannot import module" not in result.stderr, result.stderr
