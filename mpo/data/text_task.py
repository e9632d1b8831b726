"""A text prompt task: rows from a RowStream, tokenized by a PromptEncoder, too-long prompts skipped and counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .chat import PromptEncoder
from .sources import DataError
from .stream import RowStream


@dataclass(frozen=True)
class TextPrompt:
    """One tokenized prompt: its ids, the reference answer (and its tokens + EOS), metadata and where it came from."""

    ids: tuple[int, ...]
    answer: Any
    answer_ids: tuple[int, ...]
    metadata: dict
    source: str
    fields: dict | None = None  # the row's keys (prompt or messages, answer, the others): an environment's row


def _fields(row) -> dict:
    out = dict(row.metadata)
    if row.prompt is not None:
        out["prompt"] = row.prompt
    if row.messages is not None:
        out["messages"] = [dict(m) for m in row.messages]
    out["answer"] = row.answer
    return out


class TextTask:
    """Prompts for a text RL run.

    Args:
        max_prompt_tokens: prompts longer than this are skipped (counted in `dropped_long`); None keeps all.
    """

    max_answer_tokens = None  # no task-imposed limit: the generation budget comes from the config

    def __init__(self, stream: RowStream, encoder: PromptEncoder, *, max_prompt_tokens: int | None) -> None:
        self.stream = stream
        self.encoder = encoder
        self.max_prompt_tokens = max_prompt_tokens
        self.dropped_long = 0

    def next_prompts(self, count: int) -> list[TextPrompt]:
        out: list[TextPrompt] = []
        in_a_row = 0  # skipped since the last kept prompt: 2 x rows in a row covers a whole epoch
        while len(out) < count:
            row = self.stream.take(1)[0]
            ids = self.encoder.encode(row)
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                self.dropped_long += 1
                in_a_row += 1
                if in_a_row >= 2 * len(self.stream):  # else a set of only long prompts would spin forever
                    raise DataError(f"every prompt is longer than max_prompt_tokens={self.max_prompt_tokens} "
                                    f"(last: {row.source}, {len(ids)} tokens)")
                continue
            in_a_row = 0
            out.append(TextPrompt(ids=tuple(ids), answer=row.answer, answer_ids=tuple(self.encoder.encode_answer(row)),
                                  metadata=row.metadata, source=row.source, fields=_fields(row)))
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(), "dropped_long": self.dropped_long}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.dropped_long = int(state.get("dropped_long", 0))
