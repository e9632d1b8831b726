"""Policy losses, advantage estimators, aggregation and KL penalties for mpo (checked against tests/golden/).

Typical optimizer step::

    denoms = compute_global_denominators(mini_batch.mask, mini_batch.group_ids, mini_batch.advantages,
                                         process_group=dp_group)
    cfg = make_loss_config("dapo", eps_high=0.3)
    for mb in micro_batches:
        out = compute_policy_loss("dapo", mb, cfg, denoms)
        out.loss.backward()           # then all-reduce gradients with SUM (the weights already divide globally)
    metrics = all_reduce_metrics(merge_metrics(per_mb_metrics), dp_group)
"""

from .advantage_registry import ADVANTAGE_REGISTRY, AdvantageSpec, get_advantage, register_advantage
from .advantages import AdvantageOutput, compute_advantages
from .aggregation import AGG_MODES, GlobalDenominators, compute_global_denominators, token_weights
from .batch import LossContext, LossOutput, PolicyBatch
from .configs import (CISPOConfig, DPPOConfig, GMPOConfig, GSPOConfig, GSPORouterShiftConfig, LossConfig, PPOClipConfig,
                      PPOClipRouterShiftConfig, RSPOConfig, SAPOConfig)
from .critic_losses import positive_nll, value_loss
from .kl import KL_ESTIMATORS, kl_penalty, kl_per_token
from .metrics import all_reduce_metrics, merge_metrics
from .rollout_correction import (CORRECTION_DEFAULTS, Correction, CorrectionConfig, apply_rollout_correction,
                                 correction_counts)
from .registry import LOSS_REGISTRY, LossSpec, compute_policy_loss, get_loss, make_loss_config, register_loss
from .router_shift import (RouterShift, gamma_from_router_logits, gamma_from_sums, router_logp_at_old_topk,
                           router_shift_gamma, router_shift_sum, router_topk_overlap)
from .token_advantages import EMABaseline, TokenAdvantages, compute_token_advantages, masked_whiten


def loss_names() -> list[str]:
    """All registered loss names."""
    return LOSS_REGISTRY.names()


__all__ = [
    "ADVANTAGE_REGISTRY", "AGG_MODES", "AdvantageOutput", "AdvantageSpec", "CISPOConfig", "CORRECTION_DEFAULTS",
    "Correction", "CorrectionConfig", "DPPOConfig", "EMABaseline", "TokenAdvantages", "apply_rollout_correction",
    "compute_token_advantages", "correction_counts", "masked_whiten", "positive_nll", "value_loss", "GMPOConfig",
    "GSPOConfig", "GSPORouterShiftConfig", "GlobalDenominators", "KL_ESTIMATORS", "LOSS_REGISTRY", "LossConfig",
    "LossContext", "LossOutput", "LossSpec", "PPOClipConfig", "PPOClipRouterShiftConfig", "PolicyBatch", "RSPOConfig",
    "RouterShift", "SAPOConfig", "all_reduce_metrics", "compute_advantages", "compute_global_denominators",
    "compute_policy_loss", "gamma_from_router_logits", "gamma_from_sums", "get_advantage", "get_loss", "kl_penalty",
    "kl_per_token", "loss_names", "make_loss_config", "merge_metrics", "register_advantage", "register_loss",
    "router_logp_at_old_topk", "router_shift_gamma", "router_shift_sum", "router_topk_overlap", "token_weights",
]
