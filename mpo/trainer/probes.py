"""The trainer's scores of the weight-sync probes: after a push, the engines' log-probs of a few fixed sequences are
checked against the trainer's (mpo.weight_sync.publisher, `score_probes`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpo.models.context_parallel import padded_width
from mpo.models.forward import MicroBatch, run_microbatches
from mpo.parallel.collectives import broadcast_object


def trainer_probe_logprobs(trainer, probes: list[list[int]]) -> list[list[float]]:
    """Collective: `trainer`'s log-probs of every probe sequence, on every rank (computed by the last pipeline
    stage; sequences of one length share a micro-batch)."""
    by_length: dict[int, list[int]] = {}
    for j, probe in enumerate(probes):
        by_length.setdefault(len(probe), []).append(j)
    scored: list[list[float] | None] = [None] * len(probes)
    with torch.no_grad():
        for length, rows in by_length.items():
            # trailing tokens up to a length context parallelism can split (causal: the probe's scores unchanged)
            width = padded_width(length)
            batch = MicroBatch(torch.tensor([probes[j] + [0] * (width - length) for j in rows], device=trainer.device))
            outs = run_microbatches(trainer.model, [batch],
                                    vocab_size=trainer.model_cfg.vocab_size, forward_only=True)
            for row, j in enumerate(rows if outs else []):
                scored[j] = outs[0]["logprobs"][row, :length].tolist()
    # the last global rank is on the last stage
    return broadcast_object(scored, src=dist.get_world_size() - 1, group=trainer.ctx.object_group)
