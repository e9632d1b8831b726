"""Tokenizer loading (local files only), the stop tokens of a model, and prompt / answer encoding for text tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .sources import DataError, Row

TEMPLATE_TIMEOUT_S = 10.0  # rendering one prompt takes about a millisecond
TEMPLATE_MAX_CHARS = 64 << 20  # four times the largest jsonl row (sources.MAX_ROW_BYTES)


def load_tokenizer(path: str):
    """`AutoTokenizer.from_pretrained(path)` from local files only: a run never reaches a model hub."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise DataError(f"tokenizer path {path!r}: not a directory (a checkpoint or tokenizer dir with "
                        "tokenizer.json / tokenizer_config.json is needed; nothing is downloaded)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / EnvironmentError with long messages
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"tokenizer path {path!r}: cannot load a tokenizer: {first}") from None


def _ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise DataError(f"{where}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def eos_token_ids(path: str, tokenizer) -> tuple[int, ...]:
    """The ids that end a generation: the tokenizer's eos_token_id, then generation_config.json's eos_token_id
    (an int or a list; instruct models list several, e.g. <|im_end|> and <|endoftext|>), without duplicates."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None), f"{path}: tokenizer")
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            config = json.loads(gen.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{gen}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except RecursionError:
            raise DataError(f"{gen}: invalid JSON: nested too deeply") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{gen}:{e.lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(config, dict):
            raise DataError(f"{gen}:1: expected a JSON object, got {type(config).__name__}")
        ids += _ids(config.get("eos_token_id"), f"{gen}: key 'eos_token_id'")
    out = tuple(dict.fromkeys(ids))
    if not out:
        raise DataError(f"{path}: no eos_token_id in the tokenizer or generation_config.json")
    return out


class PromptEncoder:
    """Token ids of a row's prompt (through the chat template when there is one) and of its answer.

    Args:
        chat_template: apply the tokenizer's chat template; default (None): when the tokenizer has one.
        system_prompt: a system message put before the row's messages (chat template only); a row whose messages
            start with their own system message keeps it instead.
        template_kwargs: extra variables for the template, e.g. {"enable_thinking": False} for Qwen3.
        template_timeout_s / template_max_chars: bounds on rendering one prompt (mpo.data.template); a row past
            them fails with one line naming it.

    The template is rendered by mpo.data.template.BoundedTemplate (transformers' environment, bounded) and the text
    tokenized without special tokens, as apply_chat_template(tokenize=True) does.
    """

    def __init__(self, tokenizer, *, chat_template: bool | None = None, system_prompt: str | None = None,
                 template_kwargs: dict | None = None, template_timeout_s: float = TEMPLATE_TIMEOUT_S,
                 template_max_chars: int = TEMPLATE_MAX_CHARS) -> None:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template is None:
            chat_template = has_template
        if chat_template and not has_template:
            raise DataError("chat_template=True but the tokenizer has no chat template "
                            "(set chat_template: false to encode plain prompts)")
        if system_prompt is not None and not chat_template:
            raise DataError("system_prompt needs a chat template (chat_template is off)")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.template_timeout_s = template_timeout_s
        self.template_max_chars = template_max_chars
        self._eos = getattr(tokenizer, "eos_token_id", None)
        self._template = self._compile() if chat_template else None

    def _compile(self):
        from jinja2 import TemplateSyntaxError

        from .template import BoundedTemplate

        get = getattr(self.tokenizer, "get_chat_template", None)
        source = get() if get is not None else self.tokenizer.chat_template
        try:
            return BoundedTemplate(source)
        except TemplateSyntaxError as e:
            raise DataError(f"the tokenizer's chat template does not parse: line {e.lineno}: {e.message}") from None

    def render_messages(self, messages: list[dict], *, add_generation_prompt: bool, where: str) -> str:
        """The chat template's text of `messages` (bounded, mpo.data.template); DataError naming `where`."""
        from .template import TemplateLimit

        if self._template is None:
            raise DataError(f"{where}: chat messages need the tokenizer's chat template (chat_template is off)")
        variables = {**getattr(self.tokenizer, "special_tokens_map", {}), **self.template_kwargs}
        try:
            return self._template.render(timeout_s=self.template_timeout_s, max_chars=self.template_max_chars,
                                         messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except TemplateLimit as e:
            raise DataError(f"{where}: the chat template {e}") from None
        except RecursionError:
            raise DataError(f"{where}: the chat template recursed too deeply") from None
        except Exception as e:  # noqa: BLE001 - the template's own errors (raise_exception, TypeError, ...)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise DataError(f"{where}: the chat template failed: {type(e).__name__}: {first[:200]}") from None

    def messages(self, row: Row) -> list[dict]:
        chat = list(row.messages) if row.messages is not None else [{"role": "user", "content": row.prompt}]
        if self.system_prompt is not None and chat[0].get("role") != "system":
            chat = [{"role": "system", "content": self.system_prompt}, *chat]
        return chat

    def encode(self, row: Row) -> list[int]:
        if self.chat_template:
            text = self.render_messages(self.messages(row), add_generation_prompt=True, where=row.source)
            return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if row.messages is not None and row.prompt is None:
            raise DataError(f"{row.source}: the row has chat messages but the tokenizer has no chat template "
                            "(give a 'prompt' string or a tokenizer with a chat template)")
        return list(self.tokenizer(row.prompt, add_special_tokens=True)["input_ids"])

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_answer(self, row: Row) -> list[int]:
        """The answer's tokens (str(answer), no special tokens) then the first EOS id: a supervised target."""
        ids = list(self.tokenizer(str(row.answer), add_special_tokens=False)["input_ids"])
        if self._eos is None:
            raise DataError(f"{row.source}: the tokenizer has no eos_token_id to end the answer")
        first = self._eos[0] if isinstance(self._eos, (list, tuple)) else self._eos
        return ids + [int(first)]
