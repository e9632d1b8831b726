"""Verifiable digit tasks in token space (no tokenizer needed): reverse a digit string, or add two numbers.

Tokens: 1 BOS, 2 EOS, 3 '=', 4 '+', and digit d is 10+d. A prompt is BOS, the operand digits, '=' ; the answer is the
result's digits followed by EOS. Prompts for step k are a pure function of (seed, k), so a resumed run sees the same
data as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

BOS, EOS, EQUALS, PLUS, DIGIT0 = 1, 2, 3, 4, 10


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids and the reference answer's token ids (ending in EOS)."""

    ids: tuple[int, ...]
    answer: tuple[int, ...]


def _digits(number: int, width: int | None = None) -> list[int]:
    text = str(number) if width is None else str(number).zfill(width)
    return [DIGIT0 + int(c) for c in text]


@dataclass(frozen=True)
class ToyTask:
    """`kind` is "reverse" or "add"; `digits` per operand."""

    kind: str = "reverse"
    digits: int = 3

    def make(self, generator: torch.Generator) -> Prompt:
        hi = 10**self.digits
        a = int(torch.randint(0, hi, (1,), generator=generator))
        if self.kind == "reverse":
            operand = _digits(a, self.digits)
            return Prompt((BOS, *operand, EQUALS), (*operand[::-1], EOS))
        b = int(torch.randint(0, hi, (1,), generator=generator))
        return Prompt((BOS, *_digits(a, self.digits), PLUS, *_digits(b, self.digits), EQUALS),
                      (*_digits(a + b), EOS))

    def prompts(self, seed: int, step: int, count: int, round_: int = 0) -> list[Prompt]:
        """The first `count` prompts of step `step`'s stream; `round_` > 0 selects another stream of the same step
        (dynamic sampling's further draws), hashed from (seed, step, round) so no two rounds or steps share one."""
        if round_ == 0:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        else:
            digest = hashlib.blake2b(f"mpo-toy:{seed}:{step}:{round_}".encode(), digest_size=8).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        return [self.make(generator) for _ in range(count)]

    @property
    def max_answer_tokens(self) -> int:
        return self.digits + (2 if self.kind == "add" else 1)


def toy_reward(completion: list[int], answer: tuple[int, ...]) -> float:
    """1.0 for the exact answer (EOS included); otherwise partial credit, 0.5 x fraction of answer positions right.

    Partial credit gives a tiny model a learning signal long before its first exact answer.
    """
    if tuple(completion[: len(answer)]) == answer:
        return 1.0
    right = sum(1 for got, want in zip(completion, answer) if got == want)
    return 0.5 * right / len(answer)


def task_from_name(name: str, digits: int) -> ToyTask:
    """`name` is one of mpo.data.task_spec.TOY_TASKS (config validation has checked it)."""
    return ToyTask(name.split(":", 1)[1], digits)
