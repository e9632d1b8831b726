"""Day-one training essentials (issue #27): held-out evaluation with pass@k, and the learning-rate schedule and Adam
settings through megatron's optimizer and scheduler. References are written here from the published formulas
(Chen et al. 2021 for pass@k with math.comb; megatron-LM's warmup/cosine/linear formulas; AdamW's decoupled decay),
sharing no code with mpo."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from helpers.spawn import spawn_ranks
from mpo.config import RECIPES
from mpo.config import ConfigError, ScheduleSection
from mpo.config_checks import load_config


# -- pass@k ----------------------------------------------------------------------------------------------------------

def _pass_at_k_reference(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n, c, k, expected", [(4, 0, 4, 0.0), (4, 4, 4, 1.0), (4, 1, 4, 1.0), (4, 1, 1, 0.25),
                                               (5, 2, 2, 0.7), (10, 3, 1, 0.3), (3, 1, 2, 2 / 3)])
def test_pass_at_k_on_hand_built_cases(n, c, k, expected):
    from mpo.trainer.evaluation import pass_at_k

    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_combinatorial_estimator():
    from mpo.trainer.evaluation import pass_at_k

    for n in range(1, 40):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_reference(n, c, k), abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 5, 2)


# -- the lr schedule -----------------------------------------------------------------------------------------------

def _lr_reference(step: int, *, lr: float, min_lr: float, warmup: int, steps: int, decay: str,
                  wsd_steps: int = 0) -> float:
    """megatron-LM's schedule, written out: linear warmup from 0, then constant, linear/cosine decay to min_lr, or
    WSD (held at lr, then linear to min_lr over the last wsd_steps)."""
    if warmup and step <= warmup:
        return lr * step / warmup
    if decay == "constant":
        return lr
    if decay == "wsd":
        return min_lr + (lr - min_lr) * min(1.0, 1.0 - (step - (steps - wsd_steps)) / wsd_steps)
    ratio = (step - warmup) / (steps - warmup)
    coeff = 1.0 - ratio if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + (lr - min_lr) * coeff


@pytest.mark.parametrize("decay, warmup", [("cosine", 5), ("linear", 3), ("constant", 4), ("cosine", 0), ("wsd", 3)])
def test_lr_at_every_step_is_the_schedules_formula_in_any_order(decay, warmup):
    """Over a fake optimizer's parameter groups (what megatron's scheduler writes to); steps visited out of order,
    as a resume does, give the same lr: the schedule is a function of the step."""
    from mpo.trainer.lr_schedule import LrSchedule

    schedule = ScheduleSection(steps=20, lr=1e-3, min_lr=1e-4, lr_warmup_steps=warmup, lr_decay=decay,
                               lr_wsd_decay_frac=0.3 if decay == "wsd" else 0.0, weight_decay=0.1)  # wsd: 5 of 17
    groups = [{"lr": 0.0, "weight_decay": 0.0, "wd_mult": 1.0}, {"lr": 0.0, "weight_decay": 0.0, "wd_mult": 0.0}]
    sched = LrSchedule(SimpleNamespace(param_groups=groups), schedule, lr=schedule.lr)
    for step in [*range(20), 7, 0, 19, 12]:
        expected = _lr_reference(step, lr=1e-3, min_lr=1e-4, warmup=warmup, steps=20, decay=decay, wsd_steps=5)
        assert sched.set_step(step) == pytest.approx(expected, rel=1e-12, abs=1e-15), step
        assert all(g["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15) for g in groups)
        assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0  # norms/biases: no decay


def _optimizer_worker(out_file: str) -> None:
    """One rank: the tiny model's real megatron optimizer with weight decay and Adam settings; one step on zero
    gradients moves nothing but the decoupled decay of the matrices: p <- p * (1 - lr * wd)."""
    from helpers.shim_worker import _tiny_model
    from mpo.models.ddp import make_optimizer, wrap_ddp
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.trainer.lr_schedule import LrSchedule, optimizer_settings

    initialize_parallel(ParallelConfig())
    schedule = ScheduleSection(steps=10, lr=1e-2, lr_warmup_steps=2, lr_decay="linear", weight_decay=0.5,
                               adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    model = wrap_ddp(_tiny_model())
    optimizer = make_optimizer(model, clip_grad=1.0, bf16=False, **optimizer_settings(schedule, lr=schedule.lr))
    lr = LrSchedule(optimizer, schedule, lr=schedule.lr).set_step(1)
    before = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    model.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()
    after = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    torch.save({"lr": lr, "before": before, "after": after, "groups": groups}, out_file)
    torch.distributed.destroy_process_group()


def test_weight_decay_and_adam_settings_reach_megatrons_optimizer(tmp_path):
    spawn_ranks(1, _optimizer_worker, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["lr"] == pytest.approx(1e-2 * 1 / 2)  # warmup step 1 of 2
    for group in out["groups"]:
        assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6 and group["lr"] == pytest.approx(out["lr"])
    decayed = exempt = 0
    for name, before in out["before"].items():
        after = out["after"][name]
        if before.dim() >= 2:
            torch.testing.assert_close(after, before * (1 - out["lr"] * 0.5), rtol=1e-6, atol=1e-9)
            decayed += 1
        else:
            assert torch.equal(after, before), f"{name}: a norm or bias must not decay"
            exempt += 1
    assert decayed and exempt


# -- config errors --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["eval.samples_per_prompt=0"], "eval.samples_per_prompt=0; valid values: >= 1"),
    (["eval.every=-1"], "eval.every=-1; valid values: >= 0"),
    (["eval.prompts=0"], "eval.prompts=0; valid values: >= 1"),
    (["eval.every=5", "eval.task=nosuch:task"], "eval.task:"),
    (["schedule.lr_decay=foo"], "schedule.lr_decay='foo'; valid values: 'constant', 'linear', 'cosine', 'wsd'"),
    (["schedule.lr_decay=wsd", "schedule.lr_wsd_decay_frac=0"],
     "schedule.lr_wsd_decay_frac=0.0 with lr_decay='wsd'; valid values: in (0, 1]"),
    (["schedule.lr_decay=wsd", "schedule.lr_wsd_decay_frac=1.5"], "schedule.lr_wsd_decay_frac=1.5 with"),
    (["schedule.lr_warmup_steps=-2"], "schedule.lr_warmup_steps=-2; valid values: >= 0"),
    (["schedule.lr_warmup_steps=100"], "schedule.lr_warmup_steps=100 must be below schedule.steps=100"),
    (["schedule.min_lr=0.01"], "schedule.min_lr=0.01 must be <= schedule.lr=0.001"),
    (["schedule.weight_decay=-0.1"], "schedule.weight_decay=-0.1; valid values: >= 0"),
    (["schedule.adam_beta2=1.0"], "schedule.adam_beta2=1.0; valid values: in [0, 1)"),
])
def test_bad_eval_and_schedule_values_fail_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(RECIPES / "demo_cpu.yaml", overrides)
