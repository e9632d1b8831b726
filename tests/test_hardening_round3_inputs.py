"""Issue 47 items 5 and 7 (inputs): a chat template's loops are bounded whatever they do, and four mistakes cost one
line each: a seed too large for the ranks' generators, a resume onto other data with the same row count, an HF index
naming a shard outside its directory.

Real throughout: a trained byte-level BPE tokenizer with real templates rendered by mpo's bounded renderer, the real
`mpo check-config` and `checkpoints_tools hf-to-mcore` command lines (their `main(argv)` in this process), real jsonl
files read by the real sources. Nothing is faked.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from helpers.cli import one_line, run_main
from helpers.tiny_hf import tiny_qwen3_moe
from helpers.tiny_tokenizer import build_tiny_tokenizer
from mpo.data.chat import PromptEncoder
from mpo.data.sources import DataError, Row, open_source
from mpo.data.stream import RowStream

RECIPE = Path(__file__).resolve().parents[1] / "mpo" / "recipes" / "demo_cpu.yaml"
ROW = Row(prompt="hi", messages=None, answer=1, source="t.jsonl:1")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mpo.data.chat import load_tokenizer

    return load_tokenizer(str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


# ---- item 5: loops that call, look up and print nothing ---------------------------------------------------------------

SILENT_LOOPS = {
    # 4 * 10^8 iterations over a string built once: no call, lookup or output inside the loops
    "nested-for-over-a-string": "{% set s = 'x' * 20000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}x",
    "set-in-the-loop": "{% set s = 'x' * 20000 %}{% for a in s %}{% for b in s %}{% set c = b %}{% endfor %}"
                       "{% endfor %}x",
    "loop-in-a-macro": "{% macro m(s) %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}{% endmacro %}"
                       "{% set s = 'x' * 20000 %}{{ m(s) }}",
    "filtered-loop": "{% set s = 'x' * 20000 %}{% for a in s %}{% for b in s if b %}{% endfor %}{% endfor %}x",
}


@pytest.mark.parametrize("template", list(SILENT_LOOPS.values()), ids=list(SILENT_LOOPS))
def test_hardening_template_loop_that_does_nothing_is_stopped_by_the_time_limit(tokenizer, template):
    tokenizer.chat_template = template
    encoder = PromptEncoder(tokenizer, template_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(DataError, match=r"^t.jsonl:1: the chat template took over 0.5 s"):
        encoder.encode(ROW)
    assert time.monotonic() - start < 5  # minutes without the bound


def test_hardening_template_short_silent_loop_renders_and_others_code_is_not_watched(tokenizer):
    """A loop under the bound renders as before; code outside templates is not slowed by the watch (its jumps are
    not reported: the watch is per code object)."""
    tokenizer.chat_template = "{% set s = 'ab' %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}ok"
    encoder = PromptEncoder(tokenizer, template_timeout_s=5)
    assert tokenizer.decode(encoder.encode(ROW)) == "ok"

    def plain_loop() -> int:
        n = 0
        for _ in range(1000):
            n += 1
        return n

    import sys

    from mpo.data.template import _LOOPS

    assert _LOOPS.tool is not None
    assert sys.monitoring.get_local_events(_LOOPS.tool, plain_loop.__code__) == 0
    assert plain_loop() == 1000


# ---- item 7: one line each ----------------------------------------------------------------------------------------

def test_hardening_seed_past_32_bits_is_refused_by_check_config(capsys):
    code, err = run_main(capsys, "mpo.cli", "check-config", "--config", str(RECIPE), "seed=" + "9" * 30)
    assert code == 2, err
    assert one_line(err).startswith("mpo: config error: seed=") and "valid values: in [0, 4294967295]" in err
    code, err = run_main(capsys, "mpo.cli", "check-config", "--config", str(RECIPE), f"seed={2**32 - 1}")
    assert code == 0, err


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_hardening_resume_onto_other_data_with_the_same_row_count_is_one_line(tmp_path):
    saved = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"what is {i}+{i}?", "answer": 2 * i} for i in range(40)])
    other = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"what is {i}*{i}?", "answer": i * i} for i in range(40)])
    stream = RowStream(open_source(saved), seed=5)
    stream.take(7)
    state = json.loads(json.dumps(stream.state_dict()))  # what a checkpoint holds

    with pytest.raises(DataError) as info:
        RowStream(open_source(other), seed=5).load_state_dict(state)
    message = str(info.value)
    assert "\n" not in message and message.startswith("resume: the data has the 40 rows it had when saved but not "
                                                      "the same content"), message

    moved = tmp_path / "moved"
    moved.mkdir()
    resumed = RowStream(open_source(str(shutil.copy(saved, moved / "renamed.jsonl"))), seed=5)
    resumed.load_state_dict(state)  # the same rows under another path resume
    assert [r.prompt for r in resumed.take(3)] == [r.prompt for r in stream.take(3)]

    del state["fingerprint"]  # a checkpoint from before the fingerprint resumes as it did
    RowStream(open_source(other), seed=5).load_state_dict(state)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return tiny_qwen3_moe(tmp_path_factory.mktemp("hf") / "hf")


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_hardening_hf_index_naming_a_shard_outside_the_directory_is_one_line(tiny_hf, tmp_path, capsys, where):
    hf = shutil.copytree(tiny_hf, tmp_path / "hf")
    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere" / first  # a real, readable shard: without the check the converter reads it
    outside.parent.mkdir()
    shutil.move(hf / first, outside)
    named = f"../elsewhere/{first}" if where == "parent" else str(outside)
    index["weight_map"] = {k: (named if v == first else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))

    code, err = run_main(capsys, "checkpoints_tools", "hf-to-mcore", "--hf-dir", str(hf), "--out-dir",
                      str(tmp_path / "out"))
    line = one_line(err)
    assert code == 2, err
    assert "not a file name inside the HF directory" in line and "model.safetensors.index.json" in line, line
    assert not (tmp_path / "out").exists()
