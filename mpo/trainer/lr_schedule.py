"""Learning-rate schedule and Adam settings of the policy and the critic: megatron's OptimizerParamScheduler over
megatron's optimizer, counted in RL steps.

Every optimizer step of RL step s (schedule.updates_per_step of them) uses lr(s), megatron's formulas with
num_steps = s: linear warmup from 0 over `schedule.lr_warmup_steps` (lr(s) = lr * s / warmup for s <= warmup), then
`constant`, `linear` / `cosine` decay to `schedule.min_lr` over the rest of `schedule.steps`, or `wsd` (held, then
linear to min_lr over the last `schedule.lr_wsd_decay_frac` of the steps after warmup, at least one step). The schedule
is a pure function of the step, set at the start of every step, so a resumed run continues it exactly (the step is
trainer state already). Extending `schedule.steps` of a resumed (or finished) run re-shapes a decaying schedule, as it
is a function of the step and the steps: the resume says so in one warning line (steps_change_line), then trains on the
new schedule. The critic follows the same shape from its own `algorithm.critic_lr`, its floor scaled alike
(min_lr * critic_lr / lr). Weight decay (`schedule.weight_decay`, constant) applies to matrices only: megatron's
parameter groups exempt biases and norms.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any


def optimizer_settings(schedule: Any, *, lr: float) -> dict[str, float]:
    """mpo.models.ddp.make_optimizer's Adam settings from a ScheduleSection, for a model whose peak lr is `lr`."""
    return {"lr": lr, "min_lr": schedule.min_lr * lr / schedule.lr, "weight_decay": schedule.weight_decay,
            "adam_beta1": schedule.adam_beta1, "adam_beta2": schedule.adam_beta2, "adam_eps": schedule.adam_eps}


def lr_at(schedule: Any, step: int) -> float:
    """The policy's lr at RL step `step` under ScheduleSection `schedule`."""
    groups = SimpleNamespace(param_groups=[{}])  # an optimizer stand-in: megatron's scheduler only uses its groups
    return LrSchedule(groups, schedule, lr=schedule.lr).set_step(step)


def steps_change_line(saved: dict, schedule: Any, step: int) -> str | None:
    """One line when a run resumed at `step` now runs to another `schedule.steps` than its checkpoint's config
    (`saved`, its schedule section) and its lr schedule depends on the steps (decay after warmup); None otherwise."""
    old_steps = saved.get("steps")
    if not isinstance(old_steps, int) or old_steps == schedule.steps or schedule.lr_decay == "constant":
        return None
    try:
        before = lr_at(dataclasses.replace(schedule, steps=old_steps), step)
    except Exception:  # noqa: BLE001 - an old schedule that no longer validates: still say the length changed
        before = None
    now = lr_at(schedule, step)
    was = f"{before:.3g}" if before is not None else "?"
    return (f"schedule.steps changed from {old_steps} (the checkpoint's) to {schedule.steps}: the {schedule.lr_decay} "
            f"lr schedule now spans {schedule.steps} steps, so the lr at the resumed step {step} is {now:.3g} (it was "
            f"{was} under {old_steps} steps) and decays to min_lr={schedule.min_lr:g} by step {schedule.steps}")


class LrSchedule:
    """megatron's OptimizerParamScheduler on `optimizer`, positioned by RL step (see the module docstring)."""

    def __init__(self, optimizer: Any, schedule: Any, *, lr: float) -> None:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        settings = optimizer_settings(schedule, lr=lr)
        decay = max(schedule.steps, schedule.lr_warmup_steps + 1)  # megatron: more decay steps than warmup steps
        wsd = max(1, round(schedule.lr_wsd_decay_frac * (decay - schedule.lr_warmup_steps)))  # WSD's final decay
        self.scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=lr, min_lr=settings["min_lr"],
            lr_warmup_steps=schedule.lr_warmup_steps, lr_decay_steps=decay,
            lr_decay_style="WSD" if schedule.lr_decay == "wsd" else schedule.lr_decay,
            wsd_decay_steps=wsd if schedule.lr_decay == "wsd" else None, lr_wsd_decay_style="linear",
            start_wd=schedule.weight_decay, end_wd=schedule.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        self.optimizer = optimizer

    def set_step(self, step: int) -> float:
        """Put every parameter group at RL step `step`'s lr (and weight decay); returns the lr."""
        self.scheduler.num_steps = 0
        self.scheduler.step(step)
        return self.lr

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
