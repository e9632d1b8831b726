"""Token ids of an episode's messages through the chat template, never touching the model's own tokens.

The opening is the template's rendering of reset()'s messages with the generation prompt, as a text task's prompt.
An observation is the text the template puts after an assistant turn for the new messages, plus the next generation
prompt: render(base + new, generation prompt) minus render(base), where base is a stand-in conversation ending in an
assistant turn. The template's own end of that assistant turn (Qwen: "<|im_end|>\n") is what follows the turn's
content; the part of it the model already generated (its stop token, "<|im_end|>") is dropped, so the trained
sequence reads as the template would render the whole conversation, and a turn cut at max_tokens_per_turn is closed
as the template closes one. Only this text is tokenized; the generated tokens stay exactly as sampled.
"""

from __future__ import annotations

from mpo.data.sources import DataError

_MARK = "MPO_ASSISTANT_TURN_CONTENT"  # stands for an assistant turn's content in the stand-in conversation
_BASE = ({"role": "user", "content": "MPO_USER_TURN"}, {"role": "assistant", "content": _MARK})


class TurnRenderer:
    """Opening and observation token ids for one tokenizer and chat template (a PromptEncoder with a template)."""

    def __init__(self, encoder, stop_token_ids: tuple[int, ...]) -> None:
        if not encoder.chat_template:
            raise DataError("rollout.env needs the tokenizer's chat template (data.chat_template is off or the "
                            "tokenizer has none): observations are rendered with it")
        self.encoder = encoder
        base = encoder.render_messages(list(_BASE), add_generation_prompt=False, where="rollout.env")
        at = base.rfind(_MARK)
        if at < 0:
            raise DataError("rollout.env: the chat template does not render an assistant turn's content verbatim")
        self._base = base
        self._turn_end = base[at + len(_MARK):]  # the template's text after an assistant turn's content
        # How each stop token reads as text: the part of the turn end the model has already generated.
        self._stop_text = {t: encoder.tokenizer.decode([t], skip_special_tokens=False) for t in stop_token_ids}

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.encoder.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def opening(self, messages: list[dict], where: str) -> list[int]:
        encoder = self.encoder
        if encoder.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": encoder.system_prompt}, *messages]
        return self._encode(encoder.render_messages(messages, add_generation_prompt=True, where=where))

    def observation_text(self, messages: list[dict], last_token: int | None, where: str) -> str:
        """The text appended after a generated turn ending in `last_token` (None: an empty turn)."""
        full = self.encoder.render_messages([*_BASE, *messages], add_generation_prompt=True, where=where)
        if not full.startswith(self._base):
            raise DataError(f"{where}: the chat template renders the earlier turns differently once messages follow "
                            "(it is not prefix-stable), so an observation cannot be appended as tokens")
        stop = self._stop_text.get(last_token) if last_token is not None else None
        closing = self._turn_end[len(stop):] if stop and self._turn_end.startswith(stop) else self._turn_end
        return closing + full[len(self._base):]

    def observation(self, messages: list[dict], last_token: int | None, where: str) -> list[int]:
        return self._encode(self.observation_text(messages, last_token, where))
