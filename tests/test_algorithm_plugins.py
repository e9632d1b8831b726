"""A policy loss and an advantage estimator from a user's own files (`algorithm.loss=path/to/my_loss.py:fn`,
`algorithm.advantage=path/to/my_adv.py:fn`): config validation loads them, and a real `mpo train` run of the demo's
tiny MoE trains with them (trainer ranks, mpo's engine, weight sync).

The plug-ins are written out here as a user would; the loss is REINFORCE with importance ratio exp(log_ratio) and
the estimator a group-mean baseline, so their effect is checked against hand-computed numbers too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mpo.config import ConfigError
from mpo.config_checks import load_config

RECIPE = Path(__file__).resolve().parents[1] / "mpo" / "recipes" / "demo_cpu.yaml"
LOSS = textwrap.dedent("""
    import torch

    def reinforce(ctx, cfg):
        # the shared token weights (aggregation, global denominators) times -ratio * advantage
        per_token = -torch.exp(ctx.log_ratio) * ctx.advantages
        loss = (per_token * ctx.weights).sum()
        return loss, {"my_loss_adv_mean": ctx.token_mean(ctx.advantages)}
""")
ADVANTAGE = textwrap.dedent("""
    def mean_baseline(rewards, groups, eps, verl):
        return rewards - groups.mean

    mean_baseline.needs_groups = True
""")


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "my_loss.py").write_text(LOSS)
    (tmp_path / "my_adv.py").write_text(ADVANTAGE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_plugin_loss_and_advantage_numbers(plugins):
    from mpo.algorithms import compute_policy_loss
    from mpo.algorithms.advantages import compute_advantages
    from mpo.algorithms.batch import PolicyBatch

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    out = compute_advantages(rewards, torch.tensor([0, 0, 1, 1]), estimator="my_adv.py:mean_baseline")
    assert out.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]

    logp_old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64)
    logp_new = logp_old + torch.tensor([[0.1, -0.2], [0.0, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([[2.0, 2.0], [-1.0, -1.0]], dtype=torch.float64)
    batch = PolicyBatch(logp_new=logp_new, logp_old=logp_old, advantages=adv, mask=mask,
                        group_ids=torch.tensor([0, 0]))
    result = compute_policy_loss("my_loss.py:reinforce", batch)
    # seq-mean-token-mean: each sequence's tokens averaged, then the sequences
    expected = (-(torch.exp(torch.tensor(0.1)) * 2 + torch.exp(torch.tensor(-0.2)) * 2) / 2
                - (-torch.exp(torch.tensor(0.0)) * 1)) / 2
    assert abs(result.loss.item() - expected.item()) < 1e-6
    assert "my_loss_adv_mean" in result.metrics


def test_plugin_typo_is_one_config_line(plugins):
    with pytest.raises(ConfigError, match=r"^algorithm.loss: loss 'my_loss.py:reinforc': module 'my_loss.py' has "
                                          r"no attribute 'reinforc'"):
        load_config(RECIPE, ["algorithm.loss=my_loss.py:reinforc"])
    with pytest.raises(ConfigError, match=r"^algorithm: advantage estimator 'nope.py:f': no Python file"):
        load_config(RECIPE, ["algorithm.advantage=nope.py:f"])


def test_plugin_loss_and_advantage_run_an_rl_step(plugins):
    out = plugins / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([str(Path(sys.executable).with_name("mpo")), "train", "--config", str(RECIPE),
                             "algorithm.loss=my_loss.py:reinforce", f"algorithm.advantage={plugins / 'my_adv.py'}"
                             ":mean_baseline", "schedule.steps=2", "schedule.sft_steps=0", "eval.every=0",
                             f"logging.out_dir={out}", "logging.progress=false", "logging.checkpoint_every=0",
                             "logging.tensorboard=false"], capture_output=True, text=True, env=env, cwd=plugins,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]
    assert [r["step"] for r in rows] == [0, 1]
    assert all("my_loss_adv_mean" in r and r["loss"] == r["loss"] for r in rows), rows[0].keys()
