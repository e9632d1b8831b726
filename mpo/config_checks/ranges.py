"""Checks of values alone: numeric ranges, URLs, the lr schedule's cross-field limits, logging's packages."""

from __future__ import annotations

import math
import typing
from typing import Any

from mpo.config import ConfigError, TrainConfig, _show


def check_schedule(config: TrainConfig) -> None:
    """The lr schedule's cross-field limits (megatron's OptimizerParamScheduler asserts them)."""
    s = config.schedule
    if s.min_lr > s.lr:
        raise ConfigError(f"schedule.min_lr={_show(s.min_lr)} must be <= schedule.lr={_show(s.lr)}")
    if s.lr_decay == "wsd" and not 0 < s.lr_wsd_decay_frac <= 1:
        raise ConfigError(f"schedule.lr_wsd_decay_frac={_show(s.lr_wsd_decay_frac)} with lr_decay='wsd'; valid values: "
                          f"in (0, 1]")
    if s.lr_warmup_steps and s.steps and s.lr_warmup_steps >= s.steps:
        raise ConfigError(f"schedule.lr_warmup_steps={s.lr_warmup_steps} must be below schedule.steps={s.steps}")


def module_missing(name: str) -> bool:
    """True when `name` cannot be imported (found without importing it; a module set to None in sys.modules counts
    as missing, as `import` treats it)."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name] is None
    return importlib.util.find_spec(name) is None


def check_urls(urls: tuple[str, ...]) -> None:
    """rollout.urls: each an http(s) URL with a host (and a valid port, if given): anything else (a bare host:port
    reads as the scheme "host") reaches no engine, and failed only at the first request, deep in the run."""
    from urllib.parse import urlsplit

    for i, url in enumerate(urls):
        try:
            parts = urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except ValueError:  # a port that is not a number, or out of range
            ok = False
        if not ok:
            raise ConfigError(f"rollout.urls[{i}]={_show(url)}; valid values: 'http://host:port' or "
                              "'https://host:port'")


def check_logging(config: TrainConfig) -> None:
    """logging.wandb needs the wandb package and a project name; said before any process starts."""
    lg = config.logging
    if lg.wandb and module_missing("wandb"):
        raise ConfigError("logging.wandb=true needs the wandb package: pip install 'mpo[wandb]'")
    if lg.wandb and not lg.wandb_project.strip():
        raise ConfigError(f"logging.wandb_project={lg.wandb_project!r}; valid values: a non-empty project name")


# Valid ranges of numeric fields: (test, what the message says is valid). Floats must also be finite (no nan/inf).
RANGES: dict[str, tuple[typing.Callable[[float], bool], str]] = {
    "rollout.num_engines": (lambda v: v >= 1, ">= 1"),
    "rollout.samples_per_prompt": (lambda v: v >= 1, ">= 1"),
    "rollout.max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "rollout.prompts_per_call": (lambda v: v is None or v >= 1, ">= 1 (or null: each engine's share in one call)"),
    "rollout.max_inflight_per_engine": (lambda v: v >= 1, ">= 1"),
    "rollout.temperature": (lambda v: v >= 0, ">= 0 (0 is greedy)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "rollout.request_timeout_s": (lambda v: v > 0, "> 0"),
    "rollout.tensor_parallel": (lambda v: v >= 1, ">= 1"),
    "sync.bucket_mb": (lambda v: v >= 1, ">= 1"),
    "sync.probe_max_sequences": (lambda v: v >= 1, ">= 1"),
    "rollout.max_turns": (lambda v: v >= 1, ">= 1"),
    "rollout.max_tokens_per_turn": (lambda v: v is None or v >= 1, ">= 1 (or null: rollout.max_new_tokens)"),
    "rollout.max_env_state_bytes": (lambda v: v >= 1, ">= 1 (bytes of an environment's pickled state)"),
    "algorithm.kl_coef": (lambda v: v >= 0, ">= 0 (0 disables the KL penalty)"),
    "algorithm.positive_nll_coef": (lambda v: v >= 0, ">= 0 (0 disables VAPO's positive-example NLL)"),
    "algorithm.critic_lr": (lambda v: v > 0, "> 0"),
    "algorithm.value_clip": (lambda v: v > 0, "> 0"),
    "algorithm.critic_warmup_steps": (lambda v: v >= 0, ">= 0"),
    "algorithm.max_sampling_rounds": (lambda v: v >= 1, ">= 1 (the first draw counts)"),
    "data.prompts_per_step": (lambda v: v >= 1, ">= 1"),
    "data.digits": (lambda v: v >= 1, ">= 1"),
    "data.max_prompt_tokens": (lambda v: v is None or v >= 1, ">= 1 (or null: context - rollout.max_new_tokens)"),
    "data.max_response_tokens": (lambda v: v is None or v >= 1, ">= 1 (or null: rollout.max_new_tokens)"),
    "data.max_row_bytes": (lambda v: v >= 1, ">= 1"),
    "data.samples_logged": (lambda v: v >= 0, ">= 0"),
    "reward.timeout_s": (lambda v: v > 0, "> 0"),
    "reward.workers": (lambda v: v >= 1, ">= 1"),
    "reward.max_memory_mb": (lambda v: v is None or v >= 64, ">= 64 (or null: no cap)"),
    "algorithm.overlong_buffer": (lambda v: v >= 0, ">= 0 (0: off)"),
    "schedule.steps": (lambda v: v >= 0, ">= 0"),
    "schedule.updates_per_step": (lambda v: v >= 1, ">= 1"),
    "schedule.micro_batch_size": (lambda v: v >= 1, ">= 1"),
    "schedule.max_tokens_per_microbatch": (lambda v: v is None or v >= 2,
                                           ">= 2 (tokens per packed micro-batch; null: packing off)"),
    "schedule.forward_micro_batch_size": (lambda v: v is None or v >= 1,
                                          ">= 1 (rows per forward of the old-logprob pass; null: micro_batch_size)"),
    "schedule.lr": (lambda v: v > 0, "> 0"),
    "schedule.clip_grad": (lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    "schedule.lr_warmup_steps": (lambda v: v >= 0, ">= 0 (0: no warmup)"),
    "schedule.min_lr": (lambda v: v >= 0, ">= 0"),
    "schedule.weight_decay": (lambda v: v >= 0, ">= 0 (0: none)"),
    "schedule.adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "schedule.adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "schedule.adam_eps": (lambda v: v > 0, "> 0"),
    "schedule.sft_steps": (lambda v: v >= 0, ">= 0"),
    "schedule.sft_lr": (lambda v: v > 0, "> 0"),
    "schedule.max_nonfinite_steps": (lambda v: v >= 1, ">= 1"),
    "schedule.max_staleness": (lambda v: v >= 1, ">= 1 (schedule.mode=sync has none)"),
    "eval.every": (lambda v: v >= 0, ">= 0 (0: off)"),
    "eval.prompts": (lambda v: v >= 1, ">= 1"),
    "eval.samples_per_prompt": (lambda v: v >= 1, ">= 1"),
    "eval.temperature": (lambda v: v >= 0, ">= 0 (0 is greedy)"),
    "eval.max_new_tokens": (lambda v: v is None or v >= 1, ">= 1 (or null: rollout.max_new_tokens)"),
    "logging.checkpoint_every": (lambda v: v >= 0, ">= 0 (0: only at the end)"),
    "logging.keep_checkpoints": (lambda v: v >= 1, ">= 1"),
    "logging.print_every": (lambda v: v is None or v >= 0, ">= 0 (0: no step lines; null: 1 without the progress bar)"),
    # numpy's and the engines' seeds are 32-bit; a 30-digit seed passed the old ">= 0" and overflowed inside a rank
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 4294967295]"),
    "world_size": (lambda v: v >= 1, ">= 1"),
}


def check_ranges(config: TrainConfig) -> None:
    for name, (ok, valid) in RANGES.items():
        value: Any = config
        for part in name.split("."):
            value = getattr(value, part)
        if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
            raise ConfigError(f"{name}={_show(value)}; valid values: {valid}")
