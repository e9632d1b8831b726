"""One config drives a run; a bad one fails before any process starts, with one line naming the field."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpo.config import RECIPES
from mpo.config import ConfigError
from mpo.config_checks import load_config


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.lossy=gspo"], "unknown field algorithm.lossy; valid fields of algorithm: advantage"),
    (["algorithm.loss=ppo2"], "algorithm.loss='ppo2'; valid values: cispo, dapo"),
    (["parallel.expert_parallel=3", "world_size=3"], "expert_parallel=3 does not divide num_experts=8"),
    (["parallel.tensor_parallel=3", "parallel.expert_parallel=1", "world_size=3"],
     "tensor_parallel=3 does not divide num_attention_heads=4"),
    (["world_size=3", "parallel.expert_parallel=2"],
     "world size 3 is not divisible by expert_tensor_parallel*expert_parallel"),
    (["algorithm.replay=r3", "rollout.router_in_front=true"], "algorithm.replay='r3' needs routed experts"),
    (["algorithm.replay=r5"], "algorithm.replay='r5'; valid values: 'none', 'r2', 'r3'"),
    (["schedule.lr=fast"], "schedule.lr='fast': expected float"),
    (["algorithm.loss=grpo", "algorithm.loss_args={eps_low: -1}"], "eps_low"),
    (["data.task=toy:sort"], "valid toy tasks"),
    (["algorithm.advantage=gae", "algorithm.advantage_args={lam: 2}"], "advantage_args.lam=2 must be in [0, 1]"),
    (["algorithm.advantage=gae", "algorithm.critic_lr=0"], "algorithm.critic_lr=0"),
    (["algorithm.advantage=grpo", "algorithm.advantage_args={beta: 0.9}"], "advantage_args ['beta']"),
    (["algorithm.advantage=reinforce_ema", "algorithm.advantage_args={beta: 2}"], "beta must be in [0, 1)"),
    (["algorithm.advantage=grpo", "algorithm.advantage_args={eps: -1}"], "advantage_args.eps=-1 must be >= 0"),
    (["algorithm.rollout_correction=tis"], "unknown rollout_correction 'tis'"),
    (["algorithm.rollout_correction=icepop_token", "algorithm.rollout_correction_args={cap: 2}"],
     "has no bound 'cap'"),
    (["algorithm.kl_estimator=k9"], "unknown kl_estimator 'k9'"),
    (["data.retire_pass_rate=1.5"], "data.retire_pass_rate=1.5 must be in [0, 1]"),
    (["logging.checkpoint_format=torch_dist"],
     "logging.checkpoint_format='torch_dist'; valid values: 'dp_reshardable', 'fully_reshardable'"),
    (["rollout.sync=shm"], "rollout.sync moved to sync.transport"),
    (["rollout.bucket_mb=8"], "rollout.bucket_mb moved to sync.bucket_mb"),
    (["rollout.sync_master_address=h"], "rollout.sync_master_address moved to sync.master_address"),
    (["rollout.host_shared_memory=false"], "rollout.host_shared_memory moved to sync.host_shared_memory"),
    (["schedule.forward_micro_batch_size=0"], "schedule.forward_micro_batch_size=0"),
])
def test_bad_config_fails_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(RECIPES / "demo_cpu.yaml", overrides)


def test_overrides_and_yaml_round_trip(tmp_path):
    config = load_config(RECIPES / "demo_cpu.yaml", ["algorithm.loss=sapo", "algorithm.loss_args={tau_neg: 1.2}"])
    assert config.algorithm.loss == "sapo" and config.algorithm.loss_args == {"tau_neg": 1.2}
    assert config.parallel.expert_parallel == 1 and config.world_size == 1  # the demo: one rank (issue #32)


def test_cli_rejects_bad_config_before_starting_anything(tmp_path):
    out = tmp_path / "never"
    result = subprocess.run([sys.executable, "-m", "mpo.cli", "train", "--config", str(RECIPES / "demo_cpu.yaml"),
                             f"logging.out_dir={out}", "parallel.expert_parallel=3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("mpo: config error: parallel: expert_parallel=3")
    assert not out.exists()
