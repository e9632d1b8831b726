"""Per-rank body of the end-to-end test's scoring pass: the trainer, resumed from the run's newest checkpoint at the
run's own config, scores sequences with its forward (the log-probs transformers must reproduce from the exported HF
checkpoint) and writes its weights as a torch_dist checkpoint (megatron dist_checkpointing) for mcore-to-hf."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist


def score(run_dir: str, sequences: list[list[int]], result_path: str, export_dir: str) -> None:
    from megatron.core import dist_checkpointing

    from mpo.config_checks import load_config
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.trainer.trainer import Trainer

    config = load_config(Path(run_dir) / "config.yaml")
    trainer = Trainer(config)
    step, _ = trainer.resume()  # the policy only: no rollouts here
    scored: list = [None] * len(sequences)
    with torch.no_grad():
        for i, seq in enumerate(sequences):  # one row per micro-batch: no padding to reason about
            outs = run_microbatches(trainer.model, [MicroBatch(torch.tensor([seq], device=trainer.device))],
                                    vocab_size=trainer.model_cfg.vocab_size, forward_only=True)
            if outs:
                scored[i] = outs[0]["logprobs"][0, 1:].tolist()  # position t: log p(seq[t] | seq[:t])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, scored if trainer.is_last_stage else None)
    Path(export_dir).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(trainer.gpt.sharded_state_dict(), export_dir)
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps({"step": step, "logprobs": next(g for g in gathered if g)}))
    dist.barrier()
    dist.destroy_process_group()
