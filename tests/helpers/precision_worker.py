"""Per-rank body of the FP32-LM-head tests: bf16 body with an fp32 head vs a bf16 head, both against all-fp32."""

from __future__ import annotations

from pathlib import Path

import torch

# A fresh init gives logits of O(0.1), where no rounding matters. A briefly trained model (confident, large logits
# aligned with the hidden state, as in real LMs) is where the head's bf16 rounding shows.
TRAIN_STEPS = 60


def _batch(rows: int = 4, seed: int = 3) -> torch.Tensor:
    """Arithmetic sequences mod 256: learnable in a few dozen steps."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 256, (rows, 1), generator=gen)
    step = torch.randint(1, 4, (rows, 1), generator=gen)
    return (start + step * torch.arange(16)) % 256


def _train_reference(model, vocab_size: int) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(TRAIN_STEPS):
        ids = _batch(8, seed=100 + step)
        logits = model(ids, torch.arange(16).expand(ids.shape), None)
        logp = torch.log_softmax(logits[..., :vocab_size].float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
        optimizer.zero_grad()
        (-logp.mean()).backward()
        optimizer.step()


def _logprobs(model, vocab_size: int) -> torch.Tensor:
    from megatron.core import parallel_state

    from mpo.models.forward import MicroBatch, run_microbatches

    out = run_microbatches(model, [MicroBatch(_batch())], vocab_size=vocab_size, keep_logits=True)
    result = out[0]["logprobs"] if out else None
    if out:
        assert out[0]["logits"].dtype == torch.float32
    # every rank returns the last stage's log-probs for the comparison
    return result if parallel_state.is_pipeline_last_stage() else None


def run(out_dir: str, layout: dict, save_reference: bool) -> None:
    from megatron.core import dist_checkpointing

    from mpo.models.builder import PrecisionConfig, build_model, unwrap
    from mpo.models.config import preset
    from mpo.models.ddp import wrap_ddp
    from mpo.models.fp32_head import is_fp32_lm_head
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = preset("tiny-2layer")
    parallel = ParallelConfig(**layout)
    ctx = initialize_parallel(parallel)
    out = Path(out_dir)
    ckpt = out / "fp32_ckpt"
    results: dict[str, object] = {}

    if save_reference:
        reference = build_model(cfg, parallel, ctx.device, PrecisionConfig(dtype="fp32", fp32_lm_head=False))
        _train_reference(reference, cfg.vocab_size)
        ckpt.mkdir()
        dist_checkpointing.save(reference.sharded_state_dict(), str(ckpt))
        results["fp32"] = _logprobs(reference, cfg.vocab_size)

    for name, fp32_head in (("bf16_fp32head", True), ("bf16_bf16head", False)):
        model = build_model(cfg, parallel, ctx.device, PrecisionConfig(dtype="bf16", fp32_lm_head=fp32_head))
        gpt = unwrap(model)
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), str(ckpt)))
        assert is_fp32_lm_head(model) == fp32_head
        assert gpt.output_layer.weight.dtype == (torch.float32 if fp32_head else torch.bfloat16)
        assert gpt.embedding.word_embeddings.weight.dtype == torch.bfloat16
        results[name] = _logprobs(model, cfg.vocab_size)

    # Under megatron DDP + optimizer (bf16 params, fp32 main params) the head stays fp32 through a training step.
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mpo.models.forward import MicroBatch, run_microbatches

    model = build_model(cfg, parallel, ctx.device, PrecisionConfig(dtype="bf16", fp32_lm_head=True))
    ddp = wrap_ddp(model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True), [ddp])
    head = unwrap(model).output_layer.weight
    before = head.detach().clone()
    run_microbatches(ddp, [MicroBatch(_batch())], vocab_size=cfg.vocab_size,
                     loss_fn=lambda mb, lp, ent: (-lp.sum(), {}))
    assert head.main_grad.dtype == torch.float32
    ok, _, _ = optimizer.step()
    assert ok and head.dtype == torch.float32 and not torch.equal(head.detach(), before)
    results["ddp_step_ok"] = True

    # Tied embeddings: the bf16 embedding is upcast for the head matmul and receives the gradient.
    tied = build_model(cfg.with_overrides(tie_word_embeddings=True), parallel, ctx.device,
                       PrecisionConfig(dtype="bf16", fp32_lm_head=True))
    run_microbatches(tied, [MicroBatch(_batch())], vocab_size=cfg.vocab_size,
                     loss_fn=lambda mb, lp, ent: (-lp.sum(), {}))
    embedding = unwrap(tied).embedding.word_embeddings.weight
    assert embedding.grad is not None and embedding.grad.abs().sum() > 0
    results["tied_ok"] = True

    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        torch.save(results, out / f"precision_{'_'.join(f'{k}{v}' for k, v in layout.items()) or 'tp1'}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
