"""The config's cross-field checks, above the registries they ask (losses, advantages, rewards, environments,
weight-sync transports, model presets), so that mpo.config stays data and imports none of them. `load_config` is the
checked loader every entry point uses: read, unset fields resolved as a run uses them, validated."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from mpo.config import ConfigError, TrainConfig, _coerce, _show, read_config, resolve_replay
from mpo.config_checks.inputs import check_data, check_mcore_dir, model_config
from mpo.config_checks.ranges import check_logging, check_ranges, check_schedule, check_urls
from mpo.parallel.config import LayoutError

__all__ = ["ConfigError", "load_config", "model_config", "resolve_rollout_correction", "validate"]


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read YAML (optional), apply overrides, build, resolve the unset algorithm fields and validate the config."""
    config = read_config(path, overrides)
    a, mode = config.algorithm, config.schedule.mode  # unset ones resolved here: check-config prints what a run uses
    config = dataclasses.replace(config, algorithm=dataclasses.replace(
        a, rollout_correction=resolve_rollout_correction(a.rollout_correction, mode),
        replay=a.replay if a.replay is not None else resolve_replay(mode, config.rollout.router_in_front)))
    validate(config)
    return config


def resolve_rollout_correction(kind: str | None, mode: str) -> str:
    """algorithm.rollout_correction as a run uses it: unset means none on-policy (schedule.mode=sync) and the decoupled
    objective with a truncated behaviour weight off-policy (mpo.algorithms.rollout_correction.OFF_POLICY_DEFAULT)."""
    from mpo.algorithms.rollout_correction import OFF_POLICY_DEFAULT

    if kind is not None:
        return kind
    return "none" if mode == "sync" else OFF_POLICY_DEFAULT


def validate(config: TrainConfig) -> None:
    """Cross-field checks, all before any process starts."""
    from mpo.algorithms import CorrectionConfig, get_loss, loss_names, make_loss_config
    from mpo.algorithms.advantage_registry import get_advantage
    from mpo.algorithms.kl import resolve_kl_estimator
    from mpo.algorithms.step_advantages import AdvantageConfig
    from mpo.models.config import PRESETS

    a, r, m, d = config.algorithm, config.rollout, config.model, config.data
    check_ranges(config)
    check_urls(r.urls)
    if ":" in a.loss:  # a plug-in: loaded here, so a typo fails before any rank starts
        try:
            get_loss(a.loss)
        except ValueError as exc:
            raise ConfigError(f"algorithm.loss: {exc}") from None
    elif a.loss not in loss_names():
        raise ConfigError(f"algorithm.loss={_show(a.loss)}; valid values: {', '.join(loss_names())}, or a plug-in "
                          "'module:function' / 'path/to/file.py:function'")
    loss_args = _typed_loss_args(a.loss, a.loss_args)  # outside the try: its ConfigError names the field already
    try:
        make_loss_config(a.loss, **loss_args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"algorithm.loss_args: {exc}") from None
    try:
        AdvantageConfig(a.advantage, dict(a.advantage_args))
        resolve_kl_estimator(a.kl_estimator)
        CorrectionConfig(a.rollout_correction, **a.rollout_correction_args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"algorithm: {exc}") from None
    if a.replay == "r3" and r.router_in_front:
        raise ConfigError("algorithm.replay='r3' needs routed experts from the engines, but rollout.router_in_front="
                          "true: the PyPI sglang-router drops return_routed_experts (sglang#20696)")
    from mpo.weight_sync.transports import check_transport, transport_class

    try:
        check_transport(config.sync.transport, r.engine)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if r.engine_weights == "fp8_block" and r.engine == "mpo" and config.sync.transport == "distributed":
        raise ConfigError("rollout.engine_weights='fp8_block' with sync.transport='distributed' and rollout.engine="
                          "'mpo': mpo's engine joins the group over gloo, which cannot broadcast float8; use "
                          "sync.transport 'auto', 'shm' or 'tensor' (or engine_weights='bf16')")
    if config.schedule.mode != "sync" and a.rollout_correction == "none":
        raise ConfigError(f"algorithm.rollout_correction='none' with schedule.mode={config.schedule.mode!r}: the "
                          f"samples come from older policies and nothing would correct them; leave it unset "
                          f"(tis_token) or choose tis_seq, decoupled_token, decoupled_seq, icepop_token or mis_seq")
    if r.colocate and config.schedule.mode != "sync":
        raise ConfigError(f"rollout.colocate=true needs schedule.mode='sync' (got {config.schedule.mode!r}): colocated "
                          f"engines hand their memory to the trainer, so they cannot generate while it trains")
    if r.colocate:  # engines on the trainer's GPUs: the transport must reach every one
        try:
            transport_class(config.sync.transport).check_colocated(r.engine)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if r.offload_trainer and not r.colocate:
        raise ConfigError("rollout.offload_trainer=true needs rollout.colocate=true: the trainer offloads only to make "
                          "room for engines on its own GPUs")
    if m.random_init and m.mcore_dir:
        raise ConfigError("model.random_init=true with model.mcore_dir set: a run starts from one of them; unset one")
    if m.hf_dir is None and m.preset not in PRESETS:
        raise ConfigError(f"model.preset={_show(m.preset)}; valid values: {', '.join(PRESETS)}")
    if r.samples_per_prompt < 2 and get_advantage(a.advantage).needs_groups:  # validated above
        raise ConfigError(f"rollout.samples_per_prompt={r.samples_per_prompt}: algorithm.advantage={a.advantage!r} "
                          f"takes its baseline from the prompt's group, which needs >= 2")
    if a.dynamic_sampling and r.samples_per_prompt < 2:
        raise ConfigError(f"algorithm.dynamic_sampling=true needs rollout.samples_per_prompt >= 2 (got "
                          f"{r.samples_per_prompt}): a group of one response never has reward variance")
    if d.retire_pass_rate is not None and not 0.0 <= d.retire_pass_rate <= 1.0:
        raise ConfigError(f"data.retire_pass_rate={d.retire_pass_rate} must be in [0, 1] (or null to keep all)")
    check_data(config)
    check_schedule(config)
    check_logging(config)
    model_cfg = model_config(config)
    if m.mcore_dir is not None:
        check_mcore_dir(config, model_cfg)
    try:
        config.parallel.validate(config.world_size, num_layers=model_cfg.num_layers,
                                 num_attention_heads=model_cfg.num_attention_heads,
                                 num_query_groups=model_cfg.num_query_groups, num_experts=model_cfg.num_experts)
    except LayoutError as exc:
        raise ConfigError(f"parallel: {exc}") from None


def _typed_loss_args(loss: str, loss_args: dict) -> dict:
    """loss_args coerced to the loss config's field types, so `{eps_high: abc}` fails naming the field."""
    from mpo.algorithms import get_loss

    hints = typing.get_type_hints(get_loss(loss).config_cls)
    return {key: _coerce(value, hints[key], f"algorithm.loss_args.{key}") if key in hints else value
            for key, value in loss_args.items()}
