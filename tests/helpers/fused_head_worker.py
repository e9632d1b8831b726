"""Per-rank body of the fused-head tests: one megatron model scored with the head fused into the log-probs and with
whole logits (the path the golden and layout tests pin), the same batch, loss and weights; each rank saves both runs'
log-probs, entropies, loss and every parameter's gradient (this rank's shard)."""

from __future__ import annotations

from pathlib import Path

import torch


def _batch(rows: int = 3, width: int = 14, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (rows, width), generator=gen)
    weights = torch.randn(rows, width, generator=gen)
    return ids, weights


def run(out_dir: str, layout: dict, dtype: str, tied: bool) -> None:
    from megatron.core import parallel_state

    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = preset("tiny-2layer")
    if tied:
        cfg = cfg.with_overrides(tie_word_embeddings=True)
    ctx = initialize_parallel(ParallelConfig(**layout))
    model = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype=dtype, fp32_lm_head=True))
    from mpo.models.fused_head import output_layer
    assert output_layer(model) is not None, "the fused path must be taken"
    ids, weights = _batch()
    results: dict[str, dict] = {}
    for fused in (False, True):
        model.zero_grad(set_to_none=True)

        def loss_fn(mb, logp, entropy):  # uses both outputs, so both backward branches are exercised
            loss = -(logp * weights).sum() / 10 + 0.05 * (entropy * weights.abs()).sum()
            return loss, {}

        out = run_microbatches(model, [MicroBatch(ids)], vocab_size=cfg.vocab_size, loss_fn=loss_fn,
                               fused_head=fused)
        grads = {name: p.grad.detach().double().clone() for name, p in model.named_parameters()
                 if p.grad is not None}
        results["fused" if fused else "whole"] = {
            "logprobs": out[0]["logprobs"].double() if out else None,
            "entropy": out[0]["entropy"].double() if out else None,
            "loss": out[0]["loss"].double() if out else None, "grads": grads}
    rank = torch.distributed.get_rank()
    results["last_stage"] = parallel_state.is_pipeline_last_stage()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_state(out_dir: str) -> None:
    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = preset("tiny-2layer")
    ctx = initialize_parallel(ParallelConfig())
    model = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype="bf16", fp32_lm_head=True))
    keys, params = set(model.state_dict()), [id(p) for p in model.parameters()]
    ids, _ = _batch()
    run_microbatches(model, [MicroBatch(ids)], vocab_size=cfg.vocab_size, loss_fn=lambda mb, lp, ent: (-lp.sum(), {}))
    run_microbatches(model, [MicroBatch(ids)], vocab_size=cfg.vocab_size, forward_only=True)
    assert set(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    logits = model(ids, torch.arange(ids.shape[1]).expand(ids.shape), None)
    assert logits.shape[-1] >= cfg.vocab_size  # logits again, not the head's input
    (Path(out_dir) / "ok").write_text("ok")
    torch.distributed.destroy_process_group()
