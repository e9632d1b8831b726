"""Side-by-side comparison of routing replay modes on one batch (``python -m mpo.routing.compare``).

For each mode (no replay, R2, R3) starting from the same weights:

1. old-logprob forward (forward-only; R3 replays the rollout routes, otherwise natural routing), captured;
2. update forward + backward with the configured policy loss (R2 replays step 1's capture, R3 the rollout routes),
   then one SGD step;
3. one more update forward at the new weights (same replay), captured with ``gather_at`` = step 1's experts.

Reported per mode: |logp_old - logp_rollout| (mean over response tokens), variance of the importance ratio
exp(logp_update - logp_old) after the step, the loss's clip fraction there, routing agreement rollout vs old and old
vs update (of the routers' natural choices: replayed experts agree by construction), the fraction of (token, layer)
choices replay forced away from the router's own top-K in the old and the update forward, and the router's mean
|delta log p| at the old experts.

No inference engine is wired in yet: the "rollout" is a forward of a stand-in copy of the policy with the same weights
and a slightly perturbed router (``rollout_router_noise``), imitating the numeric drift between an engine and the
trainer. Its captured routes go through the SGLang format (``[n-1, L, K]`` int32 per sequence, last token unrouted)
and :func:`~mpo.routing.alignment.place_rollout_routes`, exactly as real engine routes would.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

import torch

from mpo.routing.alignment import place_rollout_routes, routes_from_record
from mpo.routing.capture import attach_routing_hooks
from mpo.routing.metrics import agreement_metrics, replay_forced_metrics, router_shift_metrics
from mpo.routing.rspo import router_logp_pairs

MODES = ("none", "r2", "r3")


@dataclass(frozen=True)
class CompareConfig:
    """Inputs of :func:`compare_replay_modes`.

    Attributes:
        preset: model preset (mpo.models.config.preset).
        loss: registered policy-loss name (e.g. "grpo", "gspo", "rspo", "grpo+rs").
        rows / micro_rows / seq / prompt_len: synthetic batch: rows split into micro-batches of micro_rows; each row
            is a prompt of prompt_len tokens plus a response, right-padded to seq.
        rollout_router_noise: std of the perturbation of the stand-in engine's router weights (relative to 1).
        lr: SGD learning rate of the single update step.
        seed: data and perturbation seed.
    """

    preset: str = "tiny"
    loss: str = "grpo"
    rows: int = 4
    micro_rows: int = 2
    seq: int = 32
    prompt_len: int = 8
    rollout_router_noise: float = 0.05
    lr: float = 0.01
    seed: int = 0


def _synthetic_batch(cfg: CompareConfig, vocab: int):
    from mpo.models.forward import MicroBatch

    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, vocab, (cfg.rows, cfg.seq), generator=gen)
    lengths = torch.randint(cfg.prompt_len + 4, cfg.seq + 1, (cfg.rows,), generator=gen)
    lengths[0] = cfg.seq
    pos = torch.arange(cfg.seq)[None]
    mask = ((pos >= cfg.prompt_len) & (pos < lengths[:, None])).float()  # scored response tokens
    adv = torch.where(torch.rand(cfg.rows, generator=gen) > 0.5, 1.0, -1.0)[:, None].expand(-1, cfg.seq).clone()
    valid = pos < lengths[:, None]  # real input positions (routing metrics)
    mbs, chunks = [], []
    for start in range(0, cfg.rows, cfg.micro_rows):
        sl = slice(start, start + cfg.micro_rows)
        mbs.append(MicroBatch(ids[sl]))
        chunks.append(dict(mask=mask[sl], adv=adv[sl], valid=valid[sl], lengths=lengths[sl]))
    return mbs, chunks


def _clipfrac(metrics: dict) -> float:
    if "clipfrac" in metrics:
        return float(metrics["clipfrac"])
    parts = [v for k, v in metrics.items() if k.endswith(("clipfrac_high", "clipfrac_low")) and "posadv" not in k]
    return float(sum(parts)) if parts else float("nan")


def _policy_batch(loss: str, logp_new, logp_old, chunk, router=None):
    from mpo.algorithms import PolicyBatch
    from mpo.algorithms.registry import get_loss

    kwargs = dict(router_logp_new=router[0], router_logp_old=router[1]) if get_loss(loss).router_shift else {}
    return PolicyBatch(logp_new=logp_new, logp_old=logp_old, advantages=chunk["adv"], mask=chunk["mask"], **kwargs)


def compare_replay_modes(cfg: CompareConfig = CompareConfig()) -> dict[str, dict[str, float]]:
    """Run the comparison in this process (megatron parallel_state initialised, one rank, no PP)."""
    from mpo.algorithms import compute_global_denominators, compute_policy_loss, make_loss_config
    from mpo.models.builder import build_model
    from mpo.models.config import preset
    from mpo.models.forward import run_microbatches
    from mpo.parallel import ParallelConfig
    from mpo.parallel.device import detect_device
    from megatron.core.transformer.moe.router import TopKRouter

    model_cfg = preset(cfg.preset)
    device = detect_device(0, force_cpu=not torch.cuda.is_available())
    parallel = ParallelConfig()
    policy = build_model(model_cfg, parallel, device)
    engine = build_model(model_cfg, parallel, device)
    engine.load_state_dict(policy.state_dict())
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for m in engine.modules():
        if isinstance(m, TopKRouter):
            m.weight.data.mul_(1 + cfg.rollout_router_noise * torch.randn(m.weight.shape, generator=gen))
    snapshot = copy.deepcopy(policy.state_dict())
    hooks, engine_hooks = attach_routing_hooks(policy), attach_routing_hooks(engine)
    mbs, chunks = _synthetic_batch(cfg, model_cfg.vocab_size)
    loss_cfg = make_loss_config(cfg.loss)
    denoms = compute_global_denominators(torch.cat([c["mask"] for c in chunks]), None,
                                         torch.cat([c["adv"] for c in chunks]))
    vocab = model_cfg.vocab_size
    valid = [c["valid"] for c in chunks]

    # The stand-in rollout: log-probs and routes, routes round-tripped through the engine's format.
    with engine_hooks.session() as rollout:
        rollout_out = run_microbatches(engine, mbs, vocab_size=vocab)
    r3 = [place_rollout_routes([[routes_from_record(rec, row, int(n))] for row, n in enumerate(c["lengths"])],
                               cfg.seq) for rec, c in zip(rollout.records, chunks)]

    report: dict[str, dict[str, float]] = {}
    for mode in MODES:
        policy.load_state_dict(snapshot)
        for p in policy.parameters():
            p.grad = None
        with hooks.session(replay=r3 if mode == "r3" else None) as old:
            old_out = run_microbatches(policy, mbs, vocab_size=vocab)
        old_logp = [o["logprobs"] for o in old_out]
        update_replay = {"none": None, "r2": old.records, "r3": r3}[mode]

        def loss_fn(mb, logprobs, entropy, _i=iter(range(len(mbs)))):
            i = next(_i)
            # Weights are still those of the old forward here, so the router shift is exactly 0 (gamma = 1).
            same = router_logp_pairs(old.records[i], old.records[i], mb.position_ids)
            out = compute_policy_loss(cfg.loss, _policy_batch(cfg.loss, logprobs, old_logp[i], chunks[i], same),
                                      loss_cfg, denoms)
            return out.loss, {}

        with hooks.session(replay=update_replay, backward=True):
            run_microbatches(policy, mbs, vocab_size=vocab, loss_fn=loss_fn)
        with torch.no_grad():
            for p in policy.parameters():
                grad = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
                if grad is not None:
                    p.add_(grad, alpha=-cfg.lr)
        with hooks.session(replay=update_replay, gather_at=old.records) as upd:
            upd_out = run_microbatches(policy, mbs, vocab_size=vocab)

        mask = torch.cat([c["mask"] for c in chunks]).bool()
        logp_old_all = torch.cat(old_logp)
        logp_upd = torch.cat([o["logprobs"] for o in upd_out])
        logp_roll = torch.cat([o["logprobs"] for o in rollout_out])
        routers = [router_logp_pairs(o, n, mb.position_ids) for o, n, mb in zip(old.records, upd.records, mbs)]
        loss_out = compute_policy_loss(
            cfg.loss, _policy_batch(cfg.loss, logp_upd, logp_old_all, {"adv": torch.cat([c["adv"] for c in chunks]),
                                                                        "mask": mask.float()},
                                    (torch.cat([r[0] for r in routers]), torch.cat([r[1] for r in routers]))),
            loss_cfg, denoms)
        ratio = torch.exp(logp_upd - logp_old_all)[mask]
        row = {
            "logp_absdiff_vs_rollout": (logp_old_all - logp_roll).abs()[mask].mean().item(),
            "ratio_var": ratio.var().item(),
            "clipfrac": _clipfrac({k: float(v) for k, v in loss_out.metrics.items()}),
        }
        natural = lambda records: [r.natural_choice() for r in records]  # noqa: E731 - the routers' own choice
        agree_ro = agreement_metrics(r3, natural(old.records), valid, prefix="rollout_vs_old")
        agree_ou = agreement_metrics(natural(old.records), natural(upd.records), valid, prefix="old_vs_update")
        shift = router_shift_metrics(old.records, upd.records, valid, prefix="old_vs_update")
        for prefix, records in (("old_replay", old.records), ("update_replay", upd.records)):
            forced = replay_forced_metrics(records, valid, prefix=prefix)
            row[f"{prefix}/forced_frac"] = forced.get(f"{prefix}/forced_frac", 0.0)
        for metrics in (agree_ro, agree_ou, shift):
            row.update({k: v for k, v in metrics.items() if "/layer" not in k and not k.endswith("/tokens")})
        report[mode] = row
    hooks.detach()
    engine_hooks.detach()
    return report


def format_report(report: dict[str, dict[str, float]]) -> str:
    keys = list(next(iter(report.values())))
    width = max(len(k) for k in keys)
    header = f"{'metric':{width}s} " + " ".join(f"{m:>12s}" for m in report)
    rows = (f"{key:{width}s} " + " ".join(f"{report[m][key]:12.6g}" for m in report) for key in keys)
    return "\n".join([header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.routing.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = CompareConfig()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = CompareConfig(**{k: getattr(args, k) for k in vars(defaults)})

    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    model_cfg = preset(cfg.preset)
    initialize_parallel(ParallelConfig(), world_size=1, rank=0, num_layers=model_cfg.num_layers,
                        num_experts=model_cfg.num_experts, num_attention_heads=model_cfg.num_attention_heads)
    print(f"routing replay comparison: loss={cfg.loss} preset={cfg.preset} rows={cfg.rows} seq={cfg.seq} "
          f"lr={cfg.lr}; 'rollout' = stand-in engine (same weights, router x (1 + {cfg.rollout_router_noise} "
          f"* N(0,1))), not a real inference engine")
    print(format_report(compare_replay_modes(cfg)))
    destroy_parallel()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
