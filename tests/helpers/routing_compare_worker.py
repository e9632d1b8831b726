"""One rank running the replay-mode comparison (mpo.routing.compare) on a small synthetic batch."""

from __future__ import annotations

import json
from pathlib import Path


def run(out_dir: str) -> None:
    import torch

    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.routing.compare import CompareConfig, compare_replay_modes

    cfg = preset("tiny")
    initialize_parallel(ParallelConfig(), num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                        num_attention_heads=cfg.num_attention_heads)
    report = compare_replay_modes(CompareConfig(rows=4, micro_rows=2, seq=24, prompt_len=6))
    (Path(out_dir) / "compare.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()
