"""Per-rank body of the context-parallel tests: the tiny model's log-probs, loss and gradients for one batch at a
layout with CP (each rank its two chunks of every row, megatron's split) or without; every rank saves the whole rows'
log-probs (gathered over CP), the loss summed over CP and its parameters' gradients summed over CP (as megatron's DDP
reduces them over data x context parallel ranks)."""

from __future__ import annotations

from pathlib import Path

import torch

SEQ, ROWS = 24, 2


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 250, (ROWS, SEQ), generator=gen)
    weights = torch.randn(ROWS, SEQ, generator=gen)
    packed_mask = None
    return ids, weights, packed_mask


def packed_mask() -> torch.Tensor:
    """Two sequences of 10 and 14 tokens packed in one row: True where a query may not attend."""
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor([10, 14]))
    return ((seq[:, None] != seq[None, :]) | torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1))[None, None]


def run(out_dir: str, layout: dict, packed: bool, ckpt: str) -> None:
    """`ckpt`: the CP1 reference saves its weights there (megatron's torch_dist), every other layout loads them (an
    expert-parallel init draws other expert weights)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.models.context_parallel import gather_from_context_parallel, split_for_context_parallel
    from mpo.models.logprobs import vocab_parallel_logprobs
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = preset("tiny-2layer")
    ctx = initialize_parallel(ParallelConfig(**layout), num_layers=cfg.num_layers, num_experts=cfg.num_experts)
    model = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype="fp32", fp32_lm_head=True))
    if not layout:
        if not Path(ckpt).exists():
            Path(ckpt).mkdir(parents=True)
            dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
    cp_group = ps.get_context_parallel_group()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    ids, weights, _ = batch()
    mask = packed_mask() if packed else None
    if packed:
        ids, weights = ids[:1], weights[:1]
    # labels: the next token, shifted over the whole row before the split (a chunk's last label is on another rank)
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    scored = torch.ones_like(weights)
    scored[:, -1] = 0
    if packed:
        scored[:, 9] = 0  # the first sequence's last token scores the second's first: not a prediction
    local = lambda x: split_for_context_parallel(x, cp_rank, cp)  # noqa: E731
    positions = torch.arange(SEQ).expand(ids.shape)
    logits = model(local(ids), local(positions), mask)
    logp, entropy = vocab_parallel_logprobs(logits, local(labels), vocab_size=cfg.vocab_size,
                                            tp_group=ps.get_tensor_model_parallel_group())
    loss = (local(weights * scored) * logp).sum() + 0.1 * (local(scored) * entropy).sum()
    loss.backward()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=cp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        torch.distributed.all_reduce(g, group=cp_group)
        grads[name] = g
    out = {"logp": gather_from_context_parallel(logp.detach(), cp_group) * scored,
           "entropy": gather_from_context_parallel(entropy.detach(), cp_group) * scored,
           "loss": total, "grads": grads}
    rank = torch.distributed.get_rank()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
