"""The built-in rewards: math (math-verify), reasoning_gym (the task's own scorer) and toy (exact match)."""

from __future__ import annotations

import functools
import math
from typing import Any

from .registry import register_reward


def _gold_text(answer: Any) -> str:
    if isinstance(answer, bool):
        raise ValueError(f"math reward: answer {answer!r} is a bool, not a number or expression")
    if isinstance(answer, int):
        return str(answer)
    if isinstance(answer, float):
        return repr(answer)  # full precision: str() could round
    return str(answer).strip()


def _warm_math() -> None:
    from math_verify import parse, verify

    verify(parse("$1$"), parse("\\boxed{1}"))  # also builds sympy's lazy caches


def _warm_reasoning_gym() -> None:
    import reasoning_gym.utils  # noqa: F401  (imports every task module)


@register_reward("math", warmup=_warm_math)
def math_reward(completion: str, answer: Any, metadata: dict) -> float:
    """1.0 if math-verify finds the completion's final answer equal to the reference, else 0.0.

    The reference is plain LaTeX or text ("\\frac{1}{2}", "0.5", 42): without math delimiters it is parsed as
    ``$answer$`` (math-verify's LaTeX extraction needs an anchor for anything but bare numbers). The completion is
    parsed with math-verify's defaults (the last \\boxed{} first, then LaTeX and plain expressions). Note the order of
    `verify(gold, prediction)`: it is not symmetric (e.g. for intervals vs inequalities).
    """
    from math_verify import parse, verify

    gold_text = _gold_text(answer)
    anchored = "$" in gold_text or "\\boxed" in gold_text or "\\(" in gold_text or "\\[" in gold_text
    gold = parse(gold_text if anchored else f"${gold_text}$") or parse(gold_text)
    if not gold:
        raise ValueError(f"math reward: math-verify cannot parse the reference answer {gold_text[:80]!r}")
    prediction = parse(completion)
    return 1.0 if prediction and verify(gold, prediction) else 0.0


@functools.lru_cache(maxsize=None)
def reasoning_gym_scorer(task: str):
    """The task's `score_answer` (from a default-config dataset: scoring reads the entry, not the config)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


@register_reward("reasoning_gym", warmup=_warm_reasoning_gym)
def reasoning_gym_reward(completion: str, answer: Any, metadata: dict) -> float:
    """The reasoning-gym task's own score of the completion for metadata["reasoning_gym"] (the dataset entry).

    reasoning-gym's prompts ask for the answer inside <answer>...</answer>: when the completion has that tag the last
    one is scored, else the whole stripped completion.
    """
    from reasoning_gym.utils import extract_answer

    try:
        entry = metadata["reasoning_gym"]
        task = entry["metadata"]["source_dataset"]
    except (KeyError, TypeError):
        raise ValueError("reasoning_gym reward needs metadata['reasoning_gym'] (the dataset entry, with "
                         "['metadata']['source_dataset']): use it with reasoning_gym:<task> data") from None
    extracted = extract_answer(completion)
    score = float(reasoning_gym_scorer(task)(extracted if extracted is not None else completion.strip(), entry))
    if not math.isfinite(score):
        raise ValueError(f"reasoning_gym task {task!r} scored {score}")
    return score


@register_reward("toy")
def toy_text_reward(completion: str, answer: Any, metadata: dict) -> float:
    """1.0 if the stripped completion equals str(answer) stripped, else 0.0 (the token-space toy tasks use
    mpo.data.toy.toy_reward instead)."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0
