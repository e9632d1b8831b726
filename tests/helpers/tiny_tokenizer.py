"""A tiny, real byte-level BPE tokenizer with Qwen-style special tokens and chat template, built offline.

`build_tiny_tokenizer(out_dir, texts)` trains a BPE on `texts` with `tokenizers`, wraps it in
`PreTrainedTokenizerFast` and `save_pretrained`s it, so `AutoTokenizer.from_pretrained(out_dir)` loads it with no hub
access. Byte-level means any text encodes (unseen characters fall back to bytes), and decode(encode(x)) == x.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen2.5's template, trimmed of tool calls: a system turn only when given, each turn wrapped in
# <|im_start|>role\n ... <|im_end|>\n, and "<|im_start|>assistant\n" as the generation prompt.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 plus 30? The answer is 42.",
    "Solve for x: 2x + 3 = 7, so x = 2.",
    "system user assistant You are a helpful assistant.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 \\frac{1}{2} \\boxed{42}",
)


def build_tiny_tokenizer(out_dir: str | Path, texts: Iterable[str] = DEFAULT_TEXTS, *,
                         vocab_size: int = 400) -> Path:
    """Train a byte-level BPE (vocab <= `vocab_size`, at most 512) on `texts`, save it to `out_dir`, return the dir.

    Special tokens: <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos, as in Qwen's instruct models).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size > 512:
        raise ValueError(f"vocab_size={vocab_size}: the tiny tokenizer stays at most 512")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = QWEN_CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out
