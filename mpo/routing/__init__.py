"""Routing capture, replay (R2/R3), RSPO router inputs and consistency metrics for megatron-core MoE models.

Typical step (one rank per stage; records are per micro-batch, batch-major ``[b, s, L_local, K]``, keyed by global
layer numbers)::

    hooks = attach_routing_hooks(model)
    with hooks.session(replay=r3_or_None) as old:               # old-logprob forward (R3: replay engine routes)
        run_microbatches(model, mbs, vocab_size=V)
    replay = old.records if mode == "r2" else r3_or_None
    with hooks.session(replay=replay, gather_at=old.records, backward=True) as cur:   # update fwd+bwd
        run_microbatches(model, mbs, vocab_size=V, loss_fn=...)
    gamma = router_shift(old.records[i], cur.records[i], gamma_min, pp_group=pp_group)  # RSPO (collective under PP)
    natural = lambda recs: [r.natural_choice() for r in recs]     # what the router chose, not what replay forced
    agreement_metrics(natural(old.records), natural(cur.records), valid, prefix="old_vs_update", pp_group=pp_group)
    replay_forced_metrics(cur.records, valid, prefix="update_replay", pp_group=pp_group)
"""

from mpo.routing.alignment import (RolloutRoutes, align_to_scored_tokens, decode_sglang_routed_experts,
                                   encode_sglang_routed_experts, place_rollout_routes, routes_from_record)
from mpo.routing.capture import CaptureConfig, RoutingHooks, SessionResult, attach_routing_hooks
from mpo.routing.metrics import agreement_metrics, replay_forced_metrics, router_shift_metrics, valid_input_positions
from mpo.routing.records import MicroBatchRouting, index_dtype
from mpo.routing.rspo import current_logp_at_old, router_logp_pairs, router_shift

__all__ = [
    "CaptureConfig", "MicroBatchRouting", "RolloutRoutes", "RoutingHooks", "SessionResult", "agreement_metrics",
    "align_to_scored_tokens", "attach_routing_hooks", "current_logp_at_old", "decode_sglang_routed_experts",
    "encode_sglang_routed_experts", "index_dtype", "place_rollout_routes", "replay_forced_metrics",
    "router_logp_pairs", "router_shift", "router_shift_metrics", "routes_from_record", "valid_input_positions",
]
