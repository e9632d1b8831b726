"""No-positive-resampling (ScaleRL, arXiv 2510.13786): a prompt whose pass rate
reaches the threshold is retired from the dataset for good. The retired set is trainer state (checkpointed and
restored on resume) and is logged as a count."""

from __future__ import annotations

import hashlib
from typing import Protocol, Sequence


class PromptSource(Protocol):
    def prompts(self, seed: int, step: int, count: int) -> list: ...


def prompt_key(prompt) -> str:
    """A stable identity of a prompt (its token ids and answer), short enough to keep millions in memory.

    Text prompts key on their answer's tokens (`answer_ids`): their `answer` may be any JSON value (an int has no
    tuple()). Toy prompts' `answer` already is the token tuple, so their keys are unchanged."""
    answer = getattr(prompt, "answer_ids", prompt.answer)
    text = repr((tuple(prompt.ids), tuple(answer)))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


class PromptRetirement:
    """Retires prompts whose pass rate reaches `threshold` and skips them when sampling.

    Args:
        threshold: pass rate (fraction of a prompt's responses with reward 1) at which it is retired; ScaleRL 0.9.
        max_draw_factor: sampling looks at most this many times the requested prompts before saying the dataset is
            exhausted (the source's stream for a step is prefix-stable, so replacements are deterministic).
    """

    def __init__(self, threshold: float, max_draw_factor: int = 64) -> None:
        self.threshold = threshold
        self.max_draw_factor = max_draw_factor
        self.retired: set[str] = set()

    def sample(self, source: PromptSource, seed: int, step: int, count: int) -> list:
        """`count` prompts of this step that are not retired (and not repeated within the step)."""
        drawn = count
        while True:
            chosen, seen = [], set()
            for prompt in source.prompts(seed, step, drawn):
                key = prompt_key(prompt)
                if key not in self.retired and key not in seen:
                    chosen.append(prompt)
                    seen.add(key)
                    if len(chosen) == count:
                        return chosen
            if drawn >= count * self.max_draw_factor:
                raise RuntimeError(f"data: only {len(chosen)} of {count} prompts left after retiring "
                                   f"{len(self.retired)} solved ones (data.retire_pass_rate={self.threshold})")
            drawn *= 2

    def observe(self, prompts: Sequence, pass_rates: Sequence[float]) -> int:
        """Retire the prompts whose pass rate reached the threshold; returns how many were retired now."""
        before = len(self.retired)
        self.retired.update(prompt_key(p) for p, rate in zip(prompts, pass_rates, strict=True)
                            if rate >= self.threshold)
        return len(self.retired) - before

    def state_dict(self) -> dict:
        return {"threshold": self.threshold, "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self.retired = set(state.get("retired", ()))
