"""Per-rank body of the vocab-parallel log-prob test: each rank holds a vocab slice of one global logits tensor."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def global_problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 9, 64, generator=gen, dtype=torch.float64) * 4  # padded vocab 64, real vocab 61
    labels = torch.randint(0, 61, (3, 9), generator=gen)
    w_logp = torch.randn(3, 9, generator=gen, dtype=torch.float64)
    w_ent = torch.randn(3, 9, generator=gen, dtype=torch.float64)
    return logits, labels, w_logp, w_ent


def run(out_dir: str) -> None:
    from mpo.models.logprobs import vocab_parallel_logprobs

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, labels, w_logp, w_ent = global_problem()
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    # Vocab 61 of 64 padded: the last rank's slice contains the padding, which must be excluded.
    logp, entropy = vocab_parallel_logprobs(local, labels, vocab_size=61, tp_group=dist.group.WORLD, chunk_tokens=4)
    ((logp * w_logp).sum() + (entropy * w_ent).sum()).backward()
    torch.save({"logp": logp.detach(), "entropy": entropy.detach(), "grad": local.grad},
               Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
