"""Hyper-parameters of the policy losses: one dataclass per loss family, validated on construction.

Defaults are each paper's recommended values (as tests/golden/ uses them). The registry attaches per-name
defaults on top (e.g. ``dapo`` = :class:`PPOClipConfig` with ``eps_high=0.28`` and ``token-mean``), and any field can be
overridden from the trainer config.
"""

from __future__ import annotations

from dataclasses import dataclass

from .aggregation import AGG_MODES, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM_NORM, TOKEN_MEAN
from .kl import resolve_kl_estimator
from .router_shift import check_gamma_min

GAMMA_MODES: tuple[str, ...] = ("pre_clip", "post_clip_literal")
DPPO_ANCHORS: tuple[str, ...] = ("old", "rollout")


# The families' bounded fields, checked on every config that has the field, in this order.
_BOUNDS = {"eps_low": ">= 0", "eps_high": ">= 0", "delta_low": ">= 0", "delta_high": ">= 0", "is_cap": "> 0",
           "tau_pos": "> 0", "tau_neg": "> 0", "is_high": "> 0"}
# The families' fields with a fixed set of values, checked last.
_CHOICES = {"gamma_mode": GAMMA_MODES, "anchor": DPPO_ANCHORS}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class LossConfig:
    """Fields shared by every loss.

    Attributes:
        agg: aggregation mode, one of ``AGG_MODES``.
        norm_const: the constant C of ``seq-mean-token-sum-norm`` (max response length); required for that mode only.
        kl_coef: beta of the KL penalty against the reference policy; 0 disables it (needs ``logp_ref`` otherwise).
        kl_estimator: ``k1``/``k2``/``k3`` (or verl's ``kl``/``mse``/``low_var_kl``).
    """

    agg: str = SEQ_MEAN_TOKEN_MEAN
    norm_const: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        _require(self.agg in AGG_MODES, f"unknown aggregation mode agg={self.agg!r}; valid modes: {', '.join(AGG_MODES)}")
        if self.agg == SEQ_MEAN_TOKEN_SUM_NORM:
            _require(self.norm_const is not None and self.norm_const > 0,
                     f"norm_const must be > 0 (the max response length) for agg={self.agg!r}, got {self.norm_const}")
        _require(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        resolve_kl_estimator(self.kl_estimator)
        for name, bound in _BOUNDS.items():
            if hasattr(self, name):
                value = getattr(self, name)
                _require(value >= 0 if bound == ">= 0" else value > 0, f"{name} must be {bound}, got {value}")
        dual_clip_c = getattr(self, "dual_clip_c", None)
        _require(dual_clip_c is None or dual_clip_c > 1.0, f"dual_clip_c must be None or > 1, got {dual_clip_c}")
        if hasattr(self, "gamma_min"):  # the router-shift families
            check_gamma_min(self.gamma_min)
        for name, choices in _CHOICES.items():
            if hasattr(self, name):
                value = getattr(self, name)
                _require(value in choices, f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class PPOClipConfig(LossConfig):
    """GRPO / DAPO / Dr.GRPO token-level PPO clip.

    Attributes:
        eps_low / eps_high: the ratio is clipped to ``[1 - eps_low, 1 + eps_high]`` (both >= 0).
        dual_clip_c: dual-clip constant for A<0 (verl uses 3.0); ``None`` (default, as in the papers) disables it.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None


@dataclass
class GSPOConfig(LossConfig):
    """GSPO and GSPO-token: the sequence ratio is clipped to ``[1 - eps_low, 1 + eps_high]`` (GSPO paper v2 values)."""

    eps_low: float = 3e-4
    eps_high: float = 4e-4


@dataclass
class SAPOConfig(LossConfig):
    """SAPO soft gate ``(4/tau) sigmoid(tau (r - 1))``; ``tau_pos`` for A>0, ``tau_neg`` otherwise (both > 0)."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05


@dataclass
class CISPOConfig(LossConfig):
    """CISPO: stop-gradient IS weight ``clip(r, is_low, is_high)`` with ABSOLUTE bounds.

    verl's ``clip_ratio_low/high`` correspond to ``is_low = 1 - clip_ratio_low``, ``is_high = 1 + clip_ratio_high``.
    ``is_low=None`` means no lower bound.
    """

    agg: str = TOKEN_MEAN
    is_low: float | None = None
    is_high: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.is_low is None or self.is_low < self.is_high,
                 f"is_low must be None or < is_high={self.is_high}, got {self.is_low}")


@dataclass
class GMPOConfig(LossConfig):
    """GMPO: token log-ratio clipped to ``[-delta_low, delta_high]`` (one-sided by sign of A) before the geometric mean."""

    delta_low: float = 0.4
    delta_high: float = 0.4


@dataclass
class RSPOConfig(GMPOConfig):
    """RSPO = GMPO with the router-shift weight gamma.

    Attributes:
        gamma_min: floor of gamma, in [0, 1]; 0 disables the floor. Keep it >= exp(-delta_low) in ``pre_clip`` mode,
            otherwise A<0 tokens with a large router shift are clipped even at ratio 1.
        gamma_mode: ``pre_clip`` (default: ratio * gamma before the clip) or ``post_clip_literal`` (the survey
            formula read literally, kept for comparison; it up-weights A<0 sequences).
    """

    gamma_min: float = 0.7
    gamma_mode: str = "pre_clip"


@dataclass
class PPOClipRouterShiftConfig(PPOClipConfig):
    """``grpo+rs`` / ``dapo+rs``: PPO clip on ``r * sg(gamma)``; ``gamma_min`` as in :class:`RSPOConfig`."""

    gamma_min: float = 0.7


@dataclass
class GSPORouterShiftConfig(GSPOConfig):
    """``gspo+rs`` / ``gspo_token+rs``: sequence ratio ``exp(mean(d + log gamma))``; ``gamma_min`` as in RSPO."""

    gamma_min: float = 0.7


@dataclass
class DPPOConfig(LossConfig):
    """DPPO (``dppo_tv`` / ``dppo_kl``): binary trust region of half-widths ``delta_low`` (A <= 0) / ``delta_high``
    (A > 0) in TV or Bernoulli-KL around the anchor, and the IS weight truncated at ``is_cap``.

    Attributes:
        anchor: ``old`` (the trainer's recomputed old policy) or ``rollout`` (the engine's log-probs).
    """

    agg: str = TOKEN_MEAN
    delta_low: float = 0.15
    delta_high: float = 0.15
    is_cap: float = 20.0
    anchor: str = "old"
