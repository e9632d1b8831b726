"""Tokenizer loading, EOS merging, prompt encoding and TextTask, with a real tiny BPE tokenizer built in the test.

The chat-template reference is the Qwen-format string written out by hand and tokenized directly.
"""
from __future__ import annotations

import json

import pytest

from helpers.tiny_tokenizer import build_tiny_tokenizer
from mpo.data.chat import PromptEncoder, eos_token_ids, load_tokenizer
from mpo.data.sources import DataError, Row
from mpo.data.stream import RowStream
from mpo.data.text_task import TextPrompt, TextTask


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return load_tokenizer(str(tok_dir))


def raw_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tiny_tokenizer_is_small_with_qwen_specials(tokenizer):
    assert len(tokenizer) <= 512
    ids = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    assert len(set(ids)) == 3 and tokenizer.unk_token_id not in ids
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = "Solve 12 + 30 = ? naïve ✓"
    assert tokenizer.decode(raw_ids(tokenizer, text)) == text  # byte-level: any text round-trips


def test_chat_template_encoding_matches_the_hand_written_format(tokenizer):
    encoder = PromptEncoder(tokenizer, system_prompt="Be brief.")
    assert encoder.chat_template  # on by default: the tokenizer has a template
    row = Row(prompt="What is 12 plus 30?", messages=None, answer="42", metadata={}, source="t:1")
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert encoder.encode(row) == raw_ids(tokenizer, expected)
    chat = Row(prompt=None, messages=({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                      {"role": "user", "content": "2+2?"}), answer=4, metadata={}, source="t:2")
    plain = PromptEncoder(tokenizer)
    assert plain.encode(chat) == raw_ids(tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo"
                                                    "<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                                                    "<|im_start|>assistant\n")
    assert plain.decode(plain.encode(chat)) == "user\nhi\nassistant\nyo\nuser\n2+2?\nassistant\n"
    own_system = Row(prompt=None, messages=({"role": "system", "content": "S"}, {"role": "user", "content": "hi"}),
                     answer=1, metadata={}, source="t:3")
    assert encoder.encode(own_system) == raw_ids(tokenizer, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi"
                                                            "<|im_end|>\n<|im_start|>assistant\n")


def test_plain_prompts_and_answers(tokenizer):
    encoder = PromptEncoder(tokenizer, chat_template=False)
    row = Row(prompt="What is 12 plus 30?", messages=None, answer=42, metadata={}, source="t:1")
    assert encoder.encode(row) == raw_ids(tokenizer, "What is 12 plus 30?")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert encoder.encode_answer(row) == raw_ids(tokenizer, "42") + [im_end]
    chat = Row(prompt=None, messages=({"role": "user", "content": "hi"},), answer=1, metadata={}, source="f.jsonl:7")
    with pytest.raises(DataError) as info:
        encoder.encode(chat)
    assert str(info.value).startswith("f.jsonl:7: the row has chat messages but the tokenizer has no chat template")


def test_eos_ids_merge_generation_config(tok_dir, tokenizer, tmp_path):
    im_end, eot = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert eos_token_ids(str(tok_dir), tokenizer) == (im_end,)
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}))
    assert eos_token_ids(str(model), tokenizer) == (im_end, eot)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eot}))
    assert eos_token_ids(str(model), tokenizer) == (im_end, eot)
    (model / "generation_config.json").write_text('{"eos_token_id": [1,\n  }')
    with pytest.raises(DataError) as info:
        eos_token_ids(str(model), tokenizer)
    assert str(info.value) == f"{model}/generation_config.json:2: invalid JSON: Expecting value"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError) as info:
        load_tokenizer(str(tmp_path / "nope"))
    assert str(info.value).startswith(f"tokenizer path '{tmp_path}/nope': not a directory")


class Rows:
    def __init__(self, prompts):
        self.prompts = prompts

    def __len__(self):
        return len(self.prompts)

    def row(self, i):
        return Row(prompt=self.prompts[i], messages=None, answer=str(i), metadata={"i": i}, source=f"rows:{i + 1}")


def test_text_task_skips_long_prompts_and_resumes(tokenizer):
    prompts = ["short one", "a much longer prompt " * 20, "x = 2", "another short", "tiny"]
    encoder = PromptEncoder(tokenizer, chat_template=False)
    limit = max(len(raw_ids(tokenizer, p)) for p in prompts if len(p) < 30)
    task = TextTask(RowStream(Rows(prompts), seed=1), encoder, max_prompt_tokens=limit)
    assert task.max_answer_tokens is None
    got = task.next_prompts(6)
    assert all(isinstance(p, TextPrompt) and len(p.ids) <= limit for p in got)
    assert all(p.ids == tuple(raw_ids(tokenizer, prompts[p.metadata["i"]])) for p in got)
    assert all(p.answer_ids[:-1] == tuple(raw_ids(tokenizer, p.answer)) for p in got)
    assert task.dropped_long >= 1  # 6 prompts from 4 short ones crossed an epoch: the long one came up at least once
    state = json.loads(json.dumps(task.state_dict()))
    after = task.next_prompts(5)
    resumed = TextTask(RowStream(Rows(prompts), seed=1), encoder, max_prompt_tokens=limit)
    resumed.load_state_dict(state)
    assert resumed.next_prompts(5) == after and resumed.dropped_long == task.dropped_long
    from mpo.data.retirement import prompt_key

    keys = {prompt_key(p) for p in got + after}  # answers are strings here; an int answer must key too
    assert len(keys) == len({p.metadata["i"] for p in got + after})
    int_answer = TextPrompt(ids=(1, 2), answer=42, answer_ids=(3, 4, 2), metadata={}, source="s:1")
    assert prompt_key(int_answer) != prompt_key(TextPrompt((1, 2), 43, (3, 5, 2), {}, "s:1"))
    all_long = TextTask(RowStream(Rows(prompts[1:2]), seed=1), encoder, max_prompt_tokens=limit)
    with pytest.raises(ValueError, match="every prompt is longer than max_prompt_tokens"):
        all_long.next_prompts(1)
