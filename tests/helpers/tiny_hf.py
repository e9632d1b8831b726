"""A tiny random Qwen3-MoE checkpoint with an offline tokenizer, for tests that start a real inference server.

Nothing here is faked: it is a genuine `Qwen3MoeForCausalLM` (random weights, fp32) saved with `save_pretrained`,
plus a real `tokenizers` WordLevel tokenizer, so a server can load it with `HF_HUB_OFFLINE=1`.
Token ids: 0 `<unk>`, 1 `<s>`, 2 `</s>`, 3 `<pad>`, then `w4` ... `w{vocab-1}`.
"""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

TINY_QWEN3_MOE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    # Wider than the default 0.02 so logprobs and router logits are far from uniform / ties.
    initializer_range=0.1,
)


def make_tokenizer(vocab: int):
    """A whitespace WordLevel tokenizer over `<unk> <s> </s> <pad> w4 ... w{vocab-1}`, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(4, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_qwen3_moe(out_dir: Path | str, seed: int = 0, vocab: int = 256) -> Path:
    """Build, save (safetensors, fp32) and return the directory of a tiny random Qwen3-MoE with its tokenizer."""
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3MoeConfig(vocab_size=vocab, **TINY_QWEN3_MOE)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(out)
    make_tokenizer(vocab).save_pretrained(out)
    return out


def load_tiny_model(model_dir: Path | str):
    """Load the saved checkpoint back in fp32 eval mode (the reference side of server comparisons)."""
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def tiny_qwen3_moe(directory: Path, *, seed: int = 0, max_shard_size: str = "100KB") -> Path:
    """The same architecture with transformers' default init, saved per-expert in many small shards (conversion
    tests: sharded index, streaming)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=256, **{**TINY_QWEN3_MOE, "initializer_range": 0.02,
                                               "max_position_embeddings": 128})
    Qwen3MoeForCausalLM(config).save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def save_fused(src: Path, directory: Path) -> Path:
    """The same weights under transformers 5's in-memory (fused expert) names, in two shards + index."""
    import json

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


# DeepSeek-V3 in miniature: MLA (q_lora 32, kv_lora 16, nope 16, rope 8, v 16), one dense first layer, a shared
# expert, sigmoid router with expert bias and group-limited top-k. topk / topk_group == 2 so megatron's group score
# (sum of the top-(topk/topk_group) experts of a group) equals HF's (sum of the top-2).
TINY_DEEPSEEK_V3 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    rope_interleave=True, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.1,
)


def tiny_deepseek_v3(directory: Path, *, seed: int = 0, max_shard_size: str = "100KB", **overrides) -> Path:
    """A tiny random DeepseekV3ForCausalLM (fp32), saved per-expert in small shards. transformers initialises the
    router's e_score_correction_bias to zeros; it is set to random values so the mapping of the bias is tested."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**TINY_DEEPSEEK_V3, **overrides})
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.1)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory
