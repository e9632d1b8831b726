"""Issue 24 items 6 and 8 (data): one bad row does not stop a run, and bad data costs one line, not a traceback.

Real files throughout (jsonl, parquet written by pyarrow and then corrupted, symlink loops on disk), a real trained
byte-level BPE tokenizer (helpers.tiny_tokenizer) with real chat templates, and the real TextRun a run builds. The
scan of a long jsonl line is shown linear by counting the bytes it examines (np.frombuffer, its only reader), not by
timing it; the template bounds by their own limits (a loop of 10^10 iterations stops at the time limit).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from helpers.tiny_tokenizer import QWEN_CHAT_TEMPLATE, build_tiny_tokenizer
from mpo.data import sources
from mpo.data.chat import PromptEncoder, eos_token_ids
from mpo.data.sources import DataError, Row, open_source


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from mpo.data.chat import load_tokenizer

    return load_tokenizer(str(tok_dir))


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# ---- item 6: a prompt longer than the context is dropped and counted, by default ------------------------------------

def test_hardening_data_prompt_longer_than_the_context_is_dropped_by_default(tok_dir, tmp_path):
    """data.max_prompt_tokens unset: the limit is the model's context minus rollout.max_new_tokens (what the engine
    accepts); the long row is dropped and counted, never sent."""
    from mpo.config_checks import load_config
    from mpo.trainer.tasks import TextRun

    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)  # > 512 tokens
    task = _jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 12 plus 30?", "answer": 42},
                                         {"prompt": long_prompt, "answer": 1}])
    config = load_config(None, [f"data.task={task}", f"model.tokenizer_dir={tok_dir}", "model.preset=tiny",
                                "rollout.max_new_tokens=64", "reward.fn=toy", "reward.workers=1"])
    run = TextRun(config)
    try:
        assert run.data.max_prompt_tokens == 512 - 64
        prompts = run.draw(0, 4)
        assert all(len(p.ids) <= 512 - 64 for p in prompts)
        assert run.dropped_long >= 1
    finally:
        run.close()


def test_hardening_data_context_smaller_than_the_response_budget_is_one_line(tok_dir, tmp_path):
    from mpo.config_checks import load_config
    from mpo.trainer.tasks import TextRun

    task = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": 1}])
    config = load_config(None, [f"data.task={task}", f"model.tokenizer_dir={tok_dir}", "model.preset=tiny",
                                "rollout.max_new_tokens=512", "reward.fn=toy", "reward.workers=1"])
    with pytest.raises(DataError, match=r"context length 512 leaves no room for a prompt"):
        TextRun(config)


# ---- item 6: long jsonl lines are scanned in linear time, and a per-row byte cap drops monsters ---------------------

def test_hardening_data_long_jsonl_line_scan_is_linear_and_capped(tmp_path, monkeypatch):
    path = tmp_path / "long.jsonl"
    big = 20 << 20
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "a", "answer": 1}) + "\n")
        f.write('{"prompt": "' + "x" * big + '", "answer": 2}\n')
        f.write("   \n")
        f.write(json.dumps({"prompt": "b", "answer": 3}) + "\n")
    size = path.stat().st_size
    examined = []
    real = np.frombuffer

    def counting(data, *args, **kwargs):
        examined.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(sources, "_SCAN_CHUNK", 1 << 20)
    monkeypatch.setattr(np, "frombuffer", counting)
    source = sources.JsonlSource(path, max_row_bytes=1 << 20)
    monkeypatch.setattr(np, "frombuffer", real)
    assert sum(examined) <= size + (1 << 20), f"the scan examined {sum(examined)} bytes of a {size}-byte file"
    assert len(source) == 2 and source.skipped_long == 1
    assert [source.row(i).answer for i in range(2)] == [1, 3]
    assert source.row(1).source.endswith(":4")  # line numbers stay the file's own


# ---- item 6: a ** glob over symlink loops terminates ---------------------------------------------------------------

@pytest.mark.timeout(60)
def test_hardening_data_glob_over_symlink_loops_terminates(tmp_path):
    root = tmp_path / "data"
    (root / "a" / "b").mkdir(parents=True)
    _jsonl(root / "a" / "b" / "x.jsonl", [{"prompt": "p", "answer": 1}])
    _jsonl(root / "top.jsonl", [{"prompt": "q", "answer": 2}])
    for name in ("loop1", "loop2", "loop3"):  # three ways back up at each level: 3^depth paths to a naive walk
        os.symlink(root, root / "a" / "b" / name)
        os.symlink(root, root / "a" / name)
    start = time.monotonic()
    source = open_source(f"{root}/**/*.jsonl")
    assert sorted(source.row(i).answer for i in range(len(source))) == [1, 2]
    assert len(open_source(str(root))) == 2
    from mpo.data.task_spec import parse_task

    assert parse_task(f"{root}/**/*.jsonl").kind == "files"
    assert time.monotonic() - start < 10


# ---- item 6: chat template rendering is bounded in time and size ---------------------------------------------------

def _encoder(tokenizer, template: str, **kwargs) -> PromptEncoder:
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return PromptEncoder(tok, **kwargs)


ROW = Row(prompt="hi", messages=None, answer=1, source="t.jsonl:1")


def test_hardening_data_template_loop_is_stopped_by_the_time_limit(tokenizer):
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    encoder = _encoder(tokenizer, template, template_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(DataError, match=r"t.jsonl:1: the chat template took over 0.5 s"):
        encoder.encode(ROW)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("template", [
    "{{ ('x' * 300000000) | length }}",
    "{{ ('%300000000s' % 'x') | length }}",
    "{{ '{:>300000000}'.format('x') | length }}",
    "{{ ('x' | center(300000000)) | length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
], ids=["multiply", "percent-width", "format-width", "filter-arg", "namespace-doubling"])
def test_hardening_data_template_string_building_is_bounded(tokenizer, template):
    # 128-300 MB each without the bound (built then measured, so the output stays small); refused, the first four
    # before allocating, the doubling at the lookup after it passes the 64M-character bound.
    encoder = _encoder(tokenizer, template)
    with pytest.raises(DataError, match=r"t.jsonl:1: the chat template would build .* over the limit of"):
        encoder.encode(ROW)


def test_hardening_data_bounded_template_matches_apply_chat_template(tokenizer):
    """The bounded renderer gives the ids transformers' apply_chat_template gives, with a system prompt and chat."""
    encoder = PromptEncoder(tokenizer, system_prompt="Be brief.")
    row = Row(prompt=None, messages=({"role": "user", "content": "What is 12 plus 30?"},
                                     {"role": "assistant", "content": "42"}, {"role": "user", "content": "why?"}),
              answer=42)
    out = tokenizer.apply_chat_template(encoder.messages(row), add_generation_prompt=True, tokenize=True)
    expected = out["input_ids"] if hasattr(out, "keys") else out
    assert encoder.encode(row) == list(expected)
    assert tokenizer.chat_template == QWEN_CHAT_TEMPLATE


# ---- item 8: one line, not a traceback ------------------------------------------------------------------------------

@pytest.mark.parametrize("line,message", [
    ('{"prompt": "p", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}", r"x.jsonl:2: invalid JSON: nested too deeply"),
    ('{"prompt": "p", "answer": ' + "7" * 5000 + "}", r"x.jsonl:2: invalid JSON: .*digits"),
    ('{"prompt": "bad \\ud800 surrogate", "answer": 1}', r"x.jsonl:2: key 'prompt' is not valid UTF-8 text"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}], "answer": 1}',
     r"x.jsonl:2: key 'messages'\[0\] is not valid UTF-8 text"),
], ids=["nested", "5000-digit-int", "surrogate-prompt", "surrogate-message"])
def test_hardening_data_bad_row_is_one_line(tmp_path, line, message):
    source = open_source(_jsonl(tmp_path / "x.jsonl", ['{"prompt": "ok", "answer": 0}', line]))
    with pytest.raises(DataError, match=message) as info:
        source.row(1 if len(source) == 2 else 0)
    assert "\n" not in str(info.value)


def test_hardening_data_corrupted_parquet_pages_are_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    table = pa.table({"prompt": [f"prompt number {i} " * 20 for i in range(2000)], "answer": list(range(2000))})
    pq.write_table(table, path, compression="zstd", row_group_size=1000)
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    for k in range(100, len(data) - footer - 100, 97):  # scribble over the pages, leave the footer intact
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))
    source = open_source(str(path))
    assert len(source) == 2000  # the footer still reads
    with pytest.raises(DataError, match=r"c.parquet:row 0: cannot read row group 0 \(corrupt file\?\): ") as info:
        source.row(0)
    assert "\n" not in str(info.value)


def test_hardening_data_chat_template_syntax_error_is_one_line(tokenizer):
    with pytest.raises(DataError, match=r"the tokenizer's chat template does not parse: line 1: ") as info:
        _encoder(tokenizer, "{% for m in messages %}{{ m['content'] }")
    assert "\n" not in str(info.value)


def test_hardening_data_non_utf8_generation_config_is_one_line(tokenizer, tmp_path):
    (tmp_path / "generation_config.json").write_bytes(b'{"eos_token_id": 2, "note": "caf\xe9"}')
    with pytest.raises(DataError, match=r"generation_config.json: not UTF-8 text") as info:
        eos_token_ids(str(tmp_path), tokenizer)
    assert "\n" not in str(info.value)
