"""Reward for math answers: the final answer (\\boxed{...} if present, else the last integer) equals the reference."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_INTEGER = re.compile(r"-?\d[\d,]*")


def extract_answer(text: str) -> str | None:
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _INTEGER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(answer: str) -> str:
    answer = answer.strip().replace(",", "").rstrip(".")
    try:
        return str(int(answer))
    except ValueError:
        return answer.replace(" ", "")


def math_reward(completion_text: str, reference: str) -> float:
    """1.0 if the completion's final answer equals the reference (integers compared numerically), else 0.0."""
    found = extract_answer(completion_text)
    return float(found is not None and _normalise(found) == _normalise(str(reference)))
