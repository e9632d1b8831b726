"""The one loss registry (name -> loss function + config class + per-name defaults) and the dispatcher.

A loss function has the signature ``fn(ctx: LossContext, cfg) -> (loss, metrics)``; it only computes its own part.
:func:`compute_policy_loss` does the shared work: denominators, token weights, router shift, common metrics and the KL
penalty. The same function may be registered under several names with different defaults (``grpo``/``dapo``/
``drgrpo`` are one PPO-clip function).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from mpo.registry import Registry

from .aggregation import GlobalDenominators, compute_global_denominators, token_weights
from .batch import LossContext, LossOutput, PolicyBatch
from .configs import LossConfig
from .kl import kl_penalty
from .metrics import stats
from .rollout_correction import Correction, CorrectionConfig, apply_rollout_correction
from .router_shift import RouterShift, router_shift_gamma

LossFn = Callable[[LossContext, Any], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its function, config class, per-name default overrides, and whether it needs gamma."""

    name: str
    fn: LossFn
    config_cls: type[LossConfig]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    router_shift: bool = False

    def make_config(self, **overrides: Any) -> LossConfig:
        """Build the config: class defaults, then this name's defaults, then ``overrides`` (e.g. from YAML)."""
        known = {f.name for f in fields(self.config_cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown hyper-parameter(s) {unknown} for loss {self.name!r}; valid: {sorted(known)}")
        return self.config_cls(**{**self.defaults, **overrides})


def _adapt_loss(name: str, obj: Any) -> LossSpec:
    """A plug-in loss: a LossSpec (kept under the user's name), or a loss function ``fn(ctx: LossContext, cfg) ->
    (loss, metrics)`` that may carry ``config_cls`` (default LossConfig), ``defaults`` and ``router_shift``."""
    if isinstance(obj, LossSpec):
        return replace(obj, name=name)
    if not callable(obj):
        raise ValueError(f"loss {name!r}: {name.rpartition(':')[2]!r} is a {type(obj).__name__}, not a loss function")
    config_cls = getattr(obj, "config_cls", LossConfig)
    if not (isinstance(config_cls, type) and issubclass(config_cls, LossConfig)):
        raise ValueError(f"loss {name!r}: config_cls must be a LossConfig subclass, got {config_cls!r}")
    return LossSpec(name, obj, config_cls, dict(getattr(obj, "defaults", {})), bool(getattr(obj, "router_shift", False)))


LOSS_REGISTRY: Registry[LossSpec] = Registry(
    "loss", plural="losses", adapt=_adapt_loss,
    builtins=("mpo.algorithms.token_losses", "mpo.algorithms.sequence_losses", "mpo.algorithms.dppo"))


def register_loss(name: str, config_cls: type[LossConfig], *, router_shift: bool = False,
                  **defaults: Any) -> Callable[[LossFn], LossFn]:
    """Decorator: register ``fn`` under ``name``. Stack it to register one function under several names."""

    def decorator(fn: LossFn) -> LossFn:
        LOSS_REGISTRY.register(name, LossSpec(name, fn, config_cls, dict(defaults), router_shift))
        return fn

    return decorator


def get_loss(name: str) -> LossSpec:
    """The loss `name`: a registered one, or a plug-in "module:attr" / "path/to/file.py:attr" (mpo.plugins) naming a
    LossSpec or a loss function (see `_adapt_loss`), loaded once and then kept in the registry under `name`."""
    return LOSS_REGISTRY.get(name)


def make_loss_config(name: str, **overrides: Any) -> LossConfig:
    """The validated config of loss ``name`` with ``overrides`` applied."""
    return get_loss(name).make_config(**overrides)


def _resolve_router_shift(name: str, batch: PolicyBatch, cfg: Any) -> RouterShift:
    if batch.router_shift is not None:
        return batch.router_shift
    if batch.router_logp_new is None or batch.router_logp_old is None:
        raise ValueError(
            f"loss {name!r} needs router log-probs: set router_logp_new and router_logp_old ([B, T, L, K] "
            "log_softmax router probs at the old top-K experts) or router_shift in the batch")
    return router_shift_gamma(batch.router_logp_new, batch.router_logp_old, cfg.gamma_min)


def _common_metrics(ctx: LossContext, batch: PolicyBatch) -> dict[str, Tensor]:
    d = ctx.log_ratio.detach()
    ratio = torch.exp(d)
    out = {"ppo_kl": ctx.token_mean(-d), **stats("ratio", ratio, ctx.valid, ctx.denoms.num_tokens),
           "log_ratio_abs_mean": ctx.token_mean(d.abs())}
    if batch.entropy is not None:
        out["entropy"] = ctx.token_mean(torch.where(ctx.valid, batch.entropy.detach(), 0))
    return out


def _router_shift_metrics(ctx: LossContext, cfg: Any) -> dict[str, Tensor]:
    shift, valid = ctx.shift, ctx.valid
    gamma = torch.exp(shift.log_gamma)
    out = stats("rspo_gamma", gamma, valid, ctx.denoms.num_tokens)
    if shift.gamma_raw is not None:
        raw = torch.where(valid, shift.gamma_raw.to(gamma.dtype), 1.0)
        out["rspo_gamma_raw_mean"] = ctx.token_mean(raw)
        out["rspo_gamma_floor_frac"] = ctx.token_frac(raw < cfg.gamma_min)
    if shift.abs_logdiff is not None:
        out["rspo_router_abs_logdiff_mean"] = ctx.token_mean(torch.where(valid, shift.abs_logdiff.to(gamma.dtype), 0.0))
    return out


def compute_policy_loss(name: str, batch: PolicyBatch, config: LossConfig | None = None,
                        denominators: GlobalDenominators | None = None, correction: CorrectionConfig | None = None,
                        correction_counts: tuple[float, float] | None = None,
                        corrected: Correction | None = None) -> LossOutput:
    """Loss and metrics of one micro-batch for the registered loss ``name``.

    Args:
        config: the loss's hyper-parameters (``make_loss_config(name, ...)``); defaults when ``None``.
        denominators: global counts of the whole optimizer mini-batch from
            :func:`~mpo.algorithms.aggregation.compute_global_denominators`. ``None`` treats this batch as the whole
            mini-batch (no gradient accumulation, no DP). With the global counts, summing ``loss`` over micro-batches
            and DP ranks equals the full-batch loss, and so do the gradients. With a rollout correction they must
            be counted over the correction's ``mask_out`` (the kept tokens).
        correction: rollout correction (needs ``batch.logp_rollout``): the loss uses the corrected mask and is
            weighted by the correction's stop-gradient weights. Its mismatch metrics are reported whenever
            ``batch.logp_rollout`` is given, also without a correction.
        correction_counts: global (valid, kept) token counts of the mini-batch
            (:func:`~mpo.algorithms.rollout_correction.correction_counts`); default: this batch's own.
        corrected: this batch's correction when the caller already applied it (the trainer does, for the global
            denominators), its metrics counted at ``correction_counts`` (:meth:`Correction.counted`); used as is.
    """
    spec = get_loss(name)
    cfg = config if config is not None else spec.make_config()
    if not isinstance(cfg, spec.config_cls):
        raise ValueError(f"loss {name!r} expects a {spec.config_cls.__name__}, got {type(cfg).__name__}")
    if corrected is not None:
        batch = replace(batch, mask=corrected.mask_out)
    elif batch.logp_rollout is not None:
        corrected = apply_rollout_correction(batch.logp_old, batch.logp_rollout, batch.mask,
                                             correction or CorrectionConfig(), correction_counts)
        batch = replace(batch, mask=corrected.mask_out)
    elif correction is not None and correction.kind != "none":
        raise ValueError(f"rollout_correction={correction.kind!r} needs the engine's log-probs (logp_rollout)")
    if denominators is None:
        denominators = compute_global_denominators(batch.mask, batch.group_ids, batch.advantages)
    shift = _resolve_router_shift(name, batch, cfg) if spec.router_shift else None
    weights = token_weights(batch.mask, cfg.agg, denominators, batch.group_ids, cfg.norm_const)
    if corrected is not None:
        weights = weights * corrected.weights.to(weights.dtype)
    ctx = LossContext.build(batch, weights, denominators, shift)

    loss, metrics = spec.fn(ctx, cfg)
    metrics = {**_common_metrics(ctx, batch), **metrics}
    if corrected is not None:
        metrics.update({f"rollout_{k}": v for k, v in corrected.metrics.items()})
    if ctx.shift is not None:
        metrics.update(_router_shift_metrics(ctx, cfg))
    if cfg.kl_coef > 0:
        if batch.logp_ref is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} > 0 needs logp_ref in the batch")
        kl_loss, kl_metrics = kl_penalty(batch.logp_new, batch.logp_ref, batch.mask, cfg.kl_estimator, cfg.agg,
                                         denominators, batch.group_ids, cfg.norm_const, logp_old=batch.logp_old)
        loss = loss + cfg.kl_coef * kl_loss
        metrics.update(kl_metrics)
    return LossOutput(loss=loss, metrics=metrics)
