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
