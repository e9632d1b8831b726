"""Per-rank body for the conversion tests: load a converted checkpoint at a layout with megatron-core, then save it
again with megatron's own dist_checkpointing.save and dump gather_full_state (megatron's view of the weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def resave(mcore_dir: str, out_dir: str, layout: dict) -> None:
    from megatron.core import dist_checkpointing

    from checkpoints_tools.convert import HF_CONFIG_NAME
    from checkpoints_tools.mapping import model_config_from_hf
    from checkpoints_tools.mcore_runner import load_checkpoint
    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.full_state import gather_full_state
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = model_config_from_hf(json.loads((Path(mcore_dir) / HF_CONFIG_NAME).read_text()))
    parallel = ParallelConfig(**layout)
    ctx = initialize_parallel(parallel, num_layers=cfg.num_layers, num_experts=cfg.num_experts)
    model = build_model(cfg, parallel, ctx.device, PrecisionConfig(dtype="fp32"), seed=999)
    load_checkpoint(model, mcore_dir)
    saved = Path(out_dir) / "megatron_saved"
    saved.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(saved))
    full = gather_full_state(model)
    if full is not None:
        torch.save(full, Path(out_dir) / "full_state.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
