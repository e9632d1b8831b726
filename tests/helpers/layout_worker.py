"""Per-rank body of the layout-equivalence tests: same weights, same data, any parallel layout.

The reference (TP1, one rank) writes a torch_dist checkpoint; every other layout loads it with megatron-core's own
resharding, runs forward+backward through megatron's schedules and DDP, and writes its logits, log-probs, entropies
and full (gathered) gradients for the test process to compare.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

GLOBAL_ROWS, SEQ, MICRO_ROWS = 4, 16, 1
VOCAB = 256


def fixed_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=gen)
    lengths = torch.tensor([16, 11, 16, 7])  # right padding in rows 1 and 3
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).float()
    mask[:, 0] = 0.0  # position 0 has no prediction
    return {
        "ids": ids,
        "mask": mask,
        "w_logp": torch.randn(GLOBAL_ROWS, SEQ, generator=gen, dtype=torch.float64).float(),
        "w_ent": torch.randn(GLOBAL_ROWS, SEQ, generator=gen, dtype=torch.float64).float(),
    }


def test_loss(mb, logprobs: torch.Tensor, entropy: torch.Tensor):
    x = mb.extras
    loss = ((logprobs * x["w_logp"] + 0.1 * entropy * x["w_ent"]) * x["mask"]).sum()
    return loss, {}


def run(out_dir: str, layout: dict, precision: dict | None = None, save_checkpoint: bool = False,
        num_layers: int = 4, finish: bool = True) -> None:
    """One layout: load (or, for the reference, save) the checkpoint of the `num_layers`-layer tiny model, forward +
    backward, then one Adam step (a trainer step: DDP reduction, clipping, the update) and the weights after it."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mpo.models.builder import PrecisionConfig, build_model, unwrap
    from mpo.models.chunks import as_chunks
    from mpo.models.config import preset
    from mpo.models.ddp import wrap_ddp
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.models.full_state import gather_full_state
    from mpo.parallel import ParallelConfig, initialize_parallel

    model_cfg = preset("tiny").with_overrides(num_layers=num_layers)
    parallel = ParallelConfig(**layout)
    ctx = initialize_parallel(parallel, num_layers=model_cfg.num_layers, num_experts=model_cfg.num_experts,
                              num_attention_heads=model_cfg.num_attention_heads)
    out = Path(out_dir)
    ckpt = out.parent / ("reference_ckpt" if num_layers == 4 else f"reference_ckpt_{num_layers}layers")
    model = build_model(model_cfg, parallel, ctx.device, PrecisionConfig(**(precision or {})))
    if save_checkpoint:
        ckpt.mkdir(exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), str(ckpt))
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(ckpt)))
    model = wrap_ddp(model)

    batch = fixed_batch()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    rows = list(range(GLOBAL_ROWS))[dp_rank::dp_size]
    microbatches = [
        MicroBatch(batch["ids"][r : r + MICRO_ROWS],
                   extras={k: v[r : r + MICRO_ROWS] for k, v in batch.items() if k != "ids"})
        for r in rows
    ]
    results = run_microbatches(model, microbatches, vocab_size=model_cfg.vocab_size, loss_fn=test_loss,
                               keep_logits=True)
    grads = gather_full_state(unwrap(model), grads=True)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.0),
                                       as_chunks(model))
    optimizer.step()
    stepped = gather_full_state(unwrap(model))

    if results:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        logits = []
        for res in results:
            parts = [torch.empty_like(res["logits"]) for _ in range(tp)]
            torch.distributed.all_gather(parts, res["logits"].contiguous(), group=tp_group)
            logits.append(torch.cat(parts, dim=-1))
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            torch.save({"rows": torch.tensor(rows),
                        "logits": torch.cat(logits), "logprobs": torch.cat([r["logprobs"] for r in results]),
                        "entropy": torch.cat([r["entropy"] for r in results])},
                       out / f"outputs_rank{torch.distributed.get_rank()}.pt")
    if grads is not None:
        torch.save(grads, out / "grads.pt")
        torch.save(stepped, out / "stepped.pt")
    torch.distributed.barrier()
    if finish:
        torch.distributed.destroy_process_group()


def run_many(jobs: list[dict]) -> None:
    """Several layouts of one world size in the same ranks (one process start-up for all of them)."""
    for job in jobs:
        run(**job, finish=False)
    torch.distributed.destroy_process_group()


def load_outputs(out_dir: Path) -> dict[str, torch.Tensor]:
    """Merge the per-DP-rank outputs back into global row order."""
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(out_dir.glob("outputs_rank*.pt")):
        part = torch.load(path, weights_only=True)
        for key in ("logits", "logprobs", "entropy"):
            if key not in merged:
                merged[key] = torch.zeros((GLOBAL_ROWS, *part[key].shape[1:]), dtype=part[key].dtype)
            merged[key][part["rows"]] = part[key]
    merged["grads"] = torch.load(out_dir / "grads.pt", weights_only=True)
    merged["stepped"] = torch.load(out_dir / "stepped.pt", weights_only=True)
    return merged
