"""Tiny random Hugging Face MoE checkpoints built by transformers itself (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def tiny_qwen3_moe(directory: Path, *, seed: int = 0, max_shard_size: str = "100KB") -> Path:
    """2-layer Qwen3-MoE (hidden 64, 4 heads / 2 KV heads, 8 experts top-2) saved per-expert in 9 shards."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                            max_position_embeddings=128)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def save_fused(src: Path, directory: Path) -> Path:
    """The same weights under transformers 5's in-memory (fused expert) names, in two shards + index."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state), "expected fused experts in memory"
    directory.mkdir(parents=True)
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        file_name = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({k: file_name for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text((src / "config.json").read_text())
    return directory


def read_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out
