"""Per-rank bodies of the routing tests (capture, R2/R3 replay, recompute, RSPO gamma, metrics; PP1 vs PP2).

`run_reference` (one rank, no PP) writes a torch_dist checkpoint and every number the tests compare; `run_pp2` loads
that checkpoint at PP2 and writes the same quantities as seen by megatron's 1F1B schedule with per-stage layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SEQ, ROWS, VOCAB = 12, 2, 256


def batch():
    """Three micro-batches: right padding (row lengths 12/7, 9/12) and one packed row (5 + 7 tokens) + padding row."""
    from mpo.models.forward import MicroBatch

    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (3, ROWS, SEQ), generator=gen)
    lengths = [torch.tensor([12, 7]), torch.tensor([9, 12]), torch.tensor([12, 6])]
    pos = torch.arange(SEQ).expand(ROWS, SEQ).clone()
    pos[0, 5:] = torch.arange(SEQ - 5)  # row 0 of micro-batch 2 packs two sequences (5 + 7 tokens)
    mbs = [MicroBatch(ids[0]), MicroBatch(ids[1]), MicroBatch(ids[2], position_ids=pos)]
    valid = [torch.arange(SEQ)[None] < n[:, None] for n in lengths]
    return mbs, valid, pos


def logp_loss(mb, logprobs, entropy):
    return logprobs.sum() * 1e-2, {}


def perturb_router(model, scale: float) -> None:
    """Deterministic per-layer perturbation (same at any PP layout: keyed by global layer number)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for m in model.modules():
        if isinstance(m, TopKRouter):
            gen = torch.Generator().manual_seed(100 + m.layer_number)
            m.weight.data.add_(scale * torch.randn(m.weight.shape, generator=gen))


def router_grads(model) -> dict[int, torch.Tensor]:
    from megatron.core.transformer.moe.router import TopKRouter

    return {m.layer_number: (m.weight.main_grad if getattr(m.weight, "main_grad", None) is not None
                             else m.weight.grad).clone()
            for m in model.modules() if isinstance(m, TopKRouter)}


def zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def records_dict(records, tag: str) -> dict[str, torch.Tensor]:
    out = {}
    for i, r in enumerate(records):
        out[f"{tag}{i}/layers"] = torch.tensor(r.layers)
        out[f"{tag}{i}/indices"] = r.indices
        out[f"{tag}{i}/logp"] = r.logp
        if r.logp_at is not None:
            out[f"{tag}{i}/logp_at"] = r.logp_at
        if r.natural is not None:
            out[f"{tag}{i}/natural"] = r.natural
    return out


def _setup(layout: dict, model_cfg=None):
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel

    model_cfg = model_cfg or preset("tiny")
    parallel = ParallelConfig(**layout)
    ctx = initialize_parallel(parallel, num_layers=model_cfg.num_layers, num_experts=model_cfg.num_experts,
                              num_attention_heads=model_cfg.num_attention_heads)
    return model_cfg, parallel, ctx


def _logits(results) -> torch.Tensor:
    return torch.stack([r["logits"] for r in results])


def run_reference(out_dir: str) -> None:
    from megatron.core import dist_checkpointing

    from mpo.models.builder import build_model
    from mpo.models.forward import run_microbatches
    from mpo.routing.capture import attach_routing_hooks
    from mpo.routing.metrics import agreement_metrics, replay_forced_metrics, router_shift_metrics
    from mpo.routing.rspo import router_shift

    out = Path(out_dir)
    cfg, parallel, ctx = _setup({})
    model = build_model(cfg, parallel, ctx.device)
    (out / "ckpt").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(out / "ckpt"))
    hooks = attach_routing_hooks(model)
    mbs, valid, pos = batch()
    res: dict[str, torch.Tensor] = {}
    run = lambda **kw: run_microbatches(model, mbs, vocab_size=VOCAB, keep_logits=True, **kw)  # noqa: E731

    # 1. Natural forward (the "old-logprob forward"): capture.
    with hooks.session() as old:
        base = run()
    res.update(records_dict(old.records, "old"))
    res["logits_base"] = _logits(base)

    # 2. R2 replay of that capture in a training fwd+bwd: same logits, router gets gradients.
    zero_grads(model)
    with hooks.session(replay=old.records, backward=True) as rep:
        replayed = run(loss_fn=logp_loss)
    res["logits_replay_same"] = _logits(replayed)
    res.update(records_dict(rep.records, "rep"))
    grads_plain = router_grads(model)
    res["router_grad_norm_replay"] = torch.tensor([g.norm() for g in grads_plain.values()])

    # 3. Replaying different (valid, distinct) indices changes the logits and is what the router reports.
    from mpo.routing.records import MicroBatchRouting
    shifted = [MicroBatchRouting(r.layers, (r.indices.long() + 1) % cfg.num_experts) for r in old.records]
    with hooks.session(replay=shifted) as rep_diff:
        diff = run()
    res["logits_replay_diff"] = _logits(diff)
    res["forced_indices_match"] = torch.tensor(all(
        torch.equal(a.indices.long(), b.indices.long()) for a, b in zip(rep_diff.records, shifted)))

    # 4. Same replay with activation recompute (megatron full recompute): logits and router grads must equal (3)'s
    #    non-recompute run; a double record / double consumption would raise inside the session.
    from mpo.models.builder import build_model as build
    hooks_rc_model = build(cfg, parallel, ctx.device, recompute=True)
    hooks_rc_model.load_state_dict(model.state_dict())
    hooks_rc = attach_routing_hooks(hooks_rc_model)
    with hooks_rc.session(replay=old.records, backward=True) as rep_rc:
        rc = run_microbatches(hooks_rc_model, mbs, vocab_size=VOCAB, keep_logits=True, loss_fn=logp_loss)
    res["logits_replay_recompute"] = _logits(rc)
    res["router_grad_max_diff_recompute"] = torch.tensor(max(
        (a - b).abs().max().item() for a, b in zip(router_grads(hooks_rc_model).values(), grads_plain.values())))
    res["recompute_records_equal"] = torch.tensor(all(
        torch.equal(a.indices, b.indices) for a, b in zip(rep_rc.records, old.records)))

    # 5. Unchanged router: gamma exactly 1.
    with hooks.session(gather_at=old.records) as same:
        run()
    g_same = [router_shift(o, n, 0.0, position_ids=mb.position_ids) for o, n, mb in zip(old.records, same.records, mbs)]
    res["gamma_same"] = torch.stack([g.gamma_raw for g in g_same])

    # 6. Perturbed router: natural routing drifts; metrics and gamma see it.
    perturb_router(model, 0.5)
    with hooks.session(gather_at=old.records) as new:
        pert = run()
    res.update(records_dict(new.records, "new"))
    res["logits_pert"] = _logits(pert)
    gammas = [router_shift(o, n, 0.0, position_ids=mb.position_ids) for o, n, mb in zip(old.records, new.records, mbs)]
    res["gamma_pert"] = torch.stack([g.gamma_raw for g in gammas])
    metrics = {**agreement_metrics(old.records, new.records, valid, prefix="old_vs_new"),
               **router_shift_metrics(old.records, new.records, valid, prefix="old_vs_new")}
    # R2 under the perturbed router: logits differ from the perturbed natural forward, routing is the old one.
    with hooks.session(replay=old.records) as r2p:
        r2_pert = run()
    res["logits_r2_pert"] = _logits(r2_pert)
    res.update(records_dict(r2p.records, "r2p"))
    metrics.update(replay_forced_metrics(r2p.records, valid, prefix="r2_forced"))
    (out / "metrics.json").write_text(json.dumps(metrics))
    torch.save(res, out / "reference.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_pp2(out_dir: str) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    from mpo.models.builder import build_model
    from mpo.models.forward import run_microbatches
    from mpo.routing.capture import attach_routing_hooks
    from mpo.routing.metrics import agreement_metrics, router_shift_metrics
    from mpo.routing.records import MicroBatchRouting
    from mpo.routing.rspo import router_shift

    out = Path(out_dir)
    cfg, parallel, ctx = _setup({"pipeline_parallel": 2})
    model = build_model(cfg, parallel, ctx.device, recompute=True)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(out / "ckpt")))
    hooks = attach_routing_hooks(model)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    mbs, valid, pos = batch()
    run = lambda **kw: run_microbatches(model, mbs, vocab_size=VOCAB, keep_logits=True, **kw)  # noqa: E731
    res: dict[str, torch.Tensor] = {}

    with hooks.session() as old:
        base = run()
    res.update(records_dict(old.records, "old"))
    # R2 with recompute inside 1F1B: replay records are this stage's own capture.
    with hooks.session(replay=old.records, backward=True):
        replayed = run(loss_fn=logp_loss)
    perturb_router(model, 0.5)
    with hooks.session(gather_at=old.records) as new:
        pert = run()
    res.update(records_dict(new.records, "new"))
    gammas = [router_shift(o, n, 0.0, position_ids=mb.position_ids, pp_group=pp_group)
              for o, n, mb in zip(old.records, new.records, mbs)]
    res["gamma_pert"] = torch.stack([g.gamma_raw for g in gammas])
    metrics = {**agreement_metrics(old.records, new.records, valid, prefix="old_vs_new",
                                   num_layers=cfg.num_layers, pp_group=pp_group),
               **router_shift_metrics(old.records, new.records, valid, prefix="old_vs_new",
                                      num_layers=cfg.num_layers, pp_group=pp_group)}
    # R3-style replay from a full-model record (all layers, e.g. the engine's): each stage selects its layers.
    full = torch.load(out / "reference.pt", weights_only=True)
    full_old = [MicroBatchRouting(tuple(full[f"old{i}/layers"].tolist()), full[f"old{i}/indices"])
                for i in range(len(mbs))]
    with hooks.session(replay=full_old, backward=True):
        r2_pert = run(loss_fn=logp_loss)
    if base:
        res["logits_base"] = _logits(base)
        res["logits_replay_same"] = _logits(replayed)
        res["logits_pert"] = _logits(pert)
        res["logits_r2_pert"] = _logits(r2_pert)
    torch.save(res, out / f"pp2_stage{stage}.pt")
    if stage == 0:
        (out / "metrics_pp2.json").write_text(json.dumps(metrics))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_golden_gamma(out_dir: str) -> None:
    """Router logits of the golden gamma cases fed as the routers' gating output through the full capture path."""
    from mpo.models.builder import build_model
    from mpo.models.config import preset
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.routing.capture import attach_routing_hooks
    from mpo.routing.rspo import router_shift

    from megatron.core.transformer.moe.router import TopKRouter

    from golden_data import load_golden

    cases = load_golden()["gamma_cases"]  # the same loader (and override) as the test that checks these numbers
    c0 = torch.tensor(cases[0]["inputs"]["router_logits_old"], dtype=torch.float64)
    b, t, n_layers, n_experts = c0.shape
    cfg = preset("tiny").with_overrides(num_layers=n_layers, num_experts=n_experts, router_topk=cases[0]["topk"])
    cfg, parallel, ctx = _setup({}, cfg)
    model = build_model(cfg, parallel, ctx.device)
    hooks = attach_routing_hooks(model)
    routers = sorted((m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda m: m.layer_number)
    mb = MicroBatch(torch.randint(0, VOCAB, (b, t + 1), generator=torch.Generator().manual_seed(3)))
    out = {}
    for ci, case in enumerate(cases):
        def set_logits(key: str) -> None:
            logits = torch.tensor(case["inputs"][key], dtype=torch.float64)  # [B, T, L, E] per scored token
            for layer, router in enumerate(routers):
                # Scored token t is routed at input position t-1: place the case's token t at position t-1.
                per_pos = torch.cat([logits[:, :, layer], torch.zeros(b, 1, n_experts, dtype=torch.float64)], 1)
                seq_major = per_pos.transpose(0, 1).contiguous()  # megatron routes [s, b, E]
                router.gating = (lambda x, v=seq_major: v.to(torch.float32))

        set_logits("router_logits_old")
        with hooks.session() as old:
            run_microbatches(model, [mb], vocab_size=VOCAB)
        set_logits("router_logits_new")
        with hooks.session(gather_at=old.records) as new:
            run_microbatches(model, [mb], vocab_size=VOCAB)
        shift = router_shift(old.records[0], new.records[0], case["gamma_min"])
        out[f"case{ci}/gamma"] = shift.log_gamma.exp()[:, 1:]
        out[f"case{ci}/gamma_raw"] = shift.gamma_raw[:, 1:]
        out[f"case{ci}/mean_abs_logdiff"] = shift.abs_logdiff[:, 1:]
        out[f"case{ci}/indices"] = old.records[0].indices[:, :t].long().sort(-1).values
    torch.save(out, Path(out_dir) / "golden_gamma.pt")
    torch.distributed.destroy_process_group()



def run_memory(out_dir: str) -> None:
    """What routing bookkeeping holds, for mpo.memory_plan.routing_parts (tests/test_memory_plan.py): the bytes of an
    old-logprob pass's records (natural, without router log-probs; R2 replay with them), and how many of the int64
    replay index tensors a forward-only replay pass made are still alive at its end (inside the session)."""
    import weakref

    from mpo.memory_plan import routing_parts
    from mpo.models.builder import build_model
    from mpo.models.forward import run_microbatches
    from mpo.routing import capture
    from mpo.routing.capture import attach_routing_hooks

    cfg, parallel, ctx = _setup({})
    model = build_model(cfg, parallel, ctx.device)
    hooks = attach_routing_hooks(model)
    mbs, _, _ = batch()

    def run():
        return run_microbatches(model, mbs, vocab_size=VOCAB, forward_only=True)

    def nbytes(records) -> int:
        return sum(t.numel() * t.element_size() for r in records
                   for t in (r.indices, r.logp, r.logp_at, r.natural) if t is not None)

    made: list = []
    original = capture._Session._local_tokens

    def tracked(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        made.append(weakref.ref(out))
        return out

    capture._Session._local_tokens = tracked
    results: dict = {}
    tokens = sum(mb.input_ids.numel() for mb in mbs)
    for name, replay, logprobs in (("none", "none", False), ("r2_rspo", "r2", True)):
        hooks.router_logprobs = logprobs
        with hooks.session() as natural:
            run()
        replayed = None
        if replay != "none":
            made.clear()
            with hooks.session(replay=natural.records) as replayed:
                run()
                alive = sum(ref() is not None for ref in made)
            results[f"{name}_int64_made"], results[f"{name}_int64_alive"] = len(made), alive
        records = (replayed or natural).records
        planned = routing_parts(cfg, parallel, 0, step_tokens=tokens, updates_per_step=1,
                                microbatch_tokens=mbs[0].input_ids.numel(), replay=replay, router_logprobs=logprobs)
        results[name] = {"measured": nbytes(records), "planned": planned["old records"]}
    capture._Session._local_tokens = original
    Path(out_dir, "routing_memory.json").write_text(json.dumps(results))
