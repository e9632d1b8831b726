"""Prompt sources (jsonl, parquet, dir/glob, reasoning-gym) and the seeded, resumable RowStream.

References are the records the tests write themselves; every bad-data case checks the exact one-line message.
"""
from __future__ import annotations

import json
import pickle

import pytest

from mpo.data import sources as sources_mod
from mpo.data.sources import DataError, Row, open_source
from mpo.data.stream import RowStream


def write_jsonl(path, records, *, raw_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def record(i):
    return {"prompt": f"question {i}?", "answer": str(i * 7), "difficulty": i % 3, "tags": ["t", str(i)]}


def test_jsonl_rows_are_read_lazily_through_offsets(tmp_path, monkeypatch):
    n = 50_000
    path = write_jsonl(tmp_path / "big.jsonl", (record(i) for i in range(n)))
    source = open_source(path)
    assert len(source) == n
    # The source holds 8 bytes a row of offsets and nothing of the rows: pickled, it is far smaller than the file.
    assert source._offsets.nbytes == 8 * n
    file_size = (tmp_path / "big.jsonl").stat().st_size
    assert len(pickle.dumps(source)) < 8 * n + 4096 < file_size / 4
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(sources_mod.json, "loads", lambda s: parsed.append(s) or real_loads(s))
    row = source.row(3)
    assert len(parsed) == 1  # reading row 3 parsed exactly one line
    assert row == Row(prompt="question 3?", messages=None, answer="21", metadata={"difficulty": 0, "tags": ["t", "3"]},
                      source=f"{path}:4")
    assert source.row(n - 1).answer == str((n - 1) * 7)
    assert source.row(n - 1).source == f"{path}:{n}"


def test_jsonl_blank_lines_crlf_bom_and_messages(tmp_path):
    path = tmp_path / "mixed.jsonl"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a", "answer": 1}).encode() + b"\r\n\n   \r\n"
                     + b'  {"messages": ' + json.dumps(chat).encode() + b', "answer": "4", "id": 9}\n'
                     + json.dumps({"prompt": "last", "answer": [1, 2]}).encode())  # no final newline
    source = open_source(str(path))
    assert len(source) == 3
    rows = [source.row(i) for i in range(3)]
    assert [r.source for r in rows] == [f"{path}:1", f"{path}:4", f"{path}:5"]
    assert rows[0].prompt == "a" and rows[0].answer == 1
    assert rows[1].prompt is None and rows[1].messages == tuple(chat) and rows[1].metadata == {"id": 9}
    assert rows[2].answer == [1, 2]


def test_key_renames_and_metadata_pass_through(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"question": "q", "solution": "s", "level": 5, "prompt": "kept"}])
    row = open_source(path, prompt_key="question", answer_key="solution").row(0)
    assert (row.prompt, row.answer, row.metadata) == ("q", "s", {"level": 5, "prompt": "kept"})
    chat_path = write_jsonl(tmp_path / "c.jsonl", [{"conv": [{"role": "user", "content": "hi"}], "answer": 1}])
    row = open_source(chat_path, messages_key="conv").row(0)
    assert row.messages == ({"role": "user", "content": "hi"},) and row.metadata == {}


def test_parquet_rows_by_row_group(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [record(i) for i in range(35)]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=10)
    source = open_source(path)
    assert len(source) == 35
    for i in (34, 0, 17, 9, 10, 33):
        row = source.row(i)
        assert (row.prompt, row.answer) == (records[i]["prompt"], records[i]["answer"])
        assert row.metadata == {"difficulty": records[i]["difficulty"], "tags": ["t", str(i)]}
        assert row.source == f"{path}:row {i}"
    assert len(sources_mod.GROUP_CACHE) <= sources_mod.PARQUET_CACHE_GROUPS


def test_parquet_stream_reads_each_row_group_once_an_epoch(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    group_sizes = [10, 10, 10, 10, 10, 10, 10, 5]  # 75 rows in 8 row groups over two files
    paths = [str(tmp_path / "part-0.parquet"), str(tmp_path / "part-1.parquet")]
    pq.write_table(pa.Table.from_pylist([record(i) for i in range(40)]), paths[0], row_group_size=10)
    pq.write_table(pa.Table.from_pylist([record(i) for i in range(40, 75)]), paths[1], row_group_size=10)
    loads = []
    real_load = sources_mod.ParquetSource._load
    monkeypatch.setattr(sources_mod.ParquetSource, "_load", lambda self, g: loads.append((self.path, g)) or
                        real_load(self, g))
    sources_mod.GROUP_CACHE._tables.clear()
    stream = RowStream(open_source(str(tmp_path)), seed=5, block_window=2)
    order = [int(r.answer) // 7 for r in stream.take(75)]
    assert sorted(order) == list(range(75))
    assert len(loads) == len(group_sizes) and len(set(loads)) == len(group_sizes)  # one decode per group
    group = [i // 10 for i in order]  # the global row group of each row, in visiting order
    last = {g: max(k for k, x in enumerate(group) if x == g) for g in set(group)}
    first = {g: group.index(g) for g in set(group)}
    # At every point at most block_window groups are open (started and not finished): rows mix within 2 groups.
    assert max(sum(first[g] <= k <= last[g] for g in first) for k in range(75)) <= 2
    assert group[:10] != sorted(group[:10]) or order[:10] != sorted(order[:10])  # shuffled inside the window


def test_parquet_chat_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "chat.parquet")
    chat = [{"role": "user", "content": "hello"}]
    pq.write_table(pa.Table.from_pylist([{"messages": chat, "answer": "x", "extra": 1.5}]), path)
    row = open_source(path).row(0)
    assert row.messages == tuple(chat) and row.answer == "x" and row.metadata == {"extra": 1.5}


def test_directory_and_glob(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "d" / "a.jsonl", [record(0), record(1)])
    pq.write_table(pa.Table.from_pylist([record(2)]), str(tmp_path / "d" / "sub" / "c.parquet"))
    write_jsonl(tmp_path / "d" / "b.jsonl", [record(3)])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    source = open_source(str(tmp_path / "d"))
    assert [source.row(i).prompt for i in range(len(source))] == \
        ["question 0?", "question 1?", "question 3?", "question 2?"]  # sorted paths: a, b, sub/c
    globbed = open_source(str(tmp_path / "d" / "*.jsonl"))
    assert [globbed.row(i).answer for i in range(len(globbed))] == ["0", "7", "21"]
    assert globbed.row(2).source == f"{tmp_path}/d/b.jsonl:1"


def _error(fn) -> str:
    with pytest.raises(DataError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_jsonl_rows_name_file_line_and_key(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [record(0)], raw_lines=[
        '{"prompt": "a", "answer": 1',  # line 2: truncated JSON
        '{"question": "q", "answer": 1}',  # line 3: no prompt
        '{"prompt": "q"}',  # line 4: no answer
        '{"prompt": 5, "answer": 1}',  # line 5: prompt not a string
        '{"messages": "hi", "answer": 1}',  # line 6: messages not a list
        '{"messages": [{"role": "user"}], "answer": 1}',  # line 7: message without content
        '{"prompt": "q", "answer": null}',  # line 8: null answer
    ])
    source = open_source(p)
    assert source.row(0).answer == "0"
    assert _error(lambda: source.row(1)) == \
        f"{p}:2: invalid JSON: Expecting ',' delimiter at column 28"
    assert _error(lambda: source.row(2)) == \
        f"{p}:3: missing key 'prompt' (or 'messages'); keys present: ['answer', 'question']"
    assert _error(lambda: source.row(3)) == f"{p}:4: missing key 'answer'; keys present: ['prompt']"
    assert _error(lambda: source.row(4)) == f"{p}:5: key 'prompt' must be a string, got int"
    assert _error(lambda: source.row(5)) == \
        f"{p}:6: key 'messages' must be a non-empty list of {{role, content}} objects, got str"
    assert _error(lambda: source.row(6)) == \
        f"{p}:7: key 'messages'[0] must be an object with string 'role' and 'content', got {{\"role\": \"user\"}}"
    assert _error(lambda: source.row(7)) == f"{p}:8: key 'answer' is null"
    renamed = open_source(p, answer_key="solution")
    assert _error(lambda: renamed.row(0)) == \
        f"{p}:1: missing key 'solution'; keys present: ['answer', 'difficulty', 'prompt', 'tags']"


def test_bad_files_fail_at_open_with_one_line(tmp_path):
    not_object = write_jsonl(tmp_path / "list.jsonl", [record(0)], raw_lines=["", "[1, 2]"])
    assert _error(lambda: open_source(not_object)) == \
        f"{not_object}:3: invalid JSON: a row must be a JSON object, got '[1, 2]'"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _error(lambda: open_source(str(empty))) == f"{empty}:1: empty file (no rows)"
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    assert _error(lambda: open_source(str(blank))) == f"{blank}:1: empty file (no rows)"
    assert _error(lambda: open_source(str(tmp_path / "nope*.jsonl"))) == \
        f"{tmp_path}/nope*.jsonl: no .jsonl or .parquet files match the glob"
    assert _error(lambda: open_source(str(tmp_path / "missing.jsonl"))) == \
        f"{tmp_path}/missing.jsonl: no such file or directory"
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    assert _error(lambda: open_source(str(csv))) == f"{csv}: unsupported file type '.csv'; valid: .jsonl, .parquet"
    (tmp_path / "emptydir").mkdir()
    assert _error(lambda: open_source(str(tmp_path / "emptydir"))) == \
        f"{tmp_path}/emptydir: directory has no .jsonl or .parquet files"


def test_bad_parquet_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "cols.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), path)
    assert _error(lambda: open_source(path)) == \
        f"{path}: missing column 'prompt' (or 'messages'); columns present: ['answer', 'question']"
    assert open_source(path, prompt_key="question").row(0).prompt == "q"
    assert _error(lambda: open_source(path, prompt_key="question", answer_key="sol")) == \
        f"{path}: missing column 'sol'; columns present: ['answer', 'question']"
    nulls = str(tmp_path / "nulls.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "answer": "a"}, {"prompt": None, "answer": "b"}]), nulls)
    assert _error(lambda: open_source(nulls).row(1)) == f"{nulls}:row 1: key 'prompt' is null (and no 'messages')"


def test_reasoning_gym_rows():
    source = open_source("reasoning_gym:spell_backward?size=4&seed=7")
    assert len(source) == 4
    row = source.row(2)
    entry = row.metadata["reasoning_gym"]
    word = entry["metadata"]["word"]
    assert row.prompt == entry["question"] and word in row.prompt
    assert row.answer == word[::-1]
    assert row.source == "reasoning_gym:spell_backward#2"
    assert pickle.loads(pickle.dumps(row)) == row
    again = open_source("reasoning_gym:spell_backward?size=4&seed=7").row(2)
    assert again == row  # entry i is a function of (seed, i)
    assert len(open_source("reasoning_gym:spell_backward")) == sources_mod.REASONING_GYM_DEFAULT_SIZE
    message = _error(lambda: open_source("reasoning_gym:spell_backwards"))
    assert message.startswith("reasoning_gym:spell_backwards: unknown reasoning_gym task 'spell_backwards'; "
                              "valid names include: ") and "spell_backward" in message
    assert _error(lambda: open_source("reasoning_gym:spell_backward?n=3")) == \
        "reasoning_gym:spell_backward?n=3: unknown option 'n'; valid: size, seed"
    assert _error(lambda: open_source("reasoning_gym:spell_backward?size=x")) == \
        "reasoning_gym:spell_backward?size=x: option size='x' must be an integer"


class ListSource:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def row(self, index):
        return Row(prompt=str(index), messages=None, answer=index, metadata={}, source=f"list:{index}")


def answers(rows):
    return [r.answer for r in rows]


def test_stream_epochs_are_seeded_permutations():
    n = 7
    stream = RowStream(ListSource(n), seed=3)
    first = answers(stream.take(n))
    assert sorted(first) == list(range(n)) and (stream.epoch, stream.position) == (0, n)
    wrapped = answers(stream.take(n + 2))
    assert (stream.epoch, stream.position) == (2, 2)
    assert sorted(wrapped[:n]) == list(range(n)) and wrapped[:n] != first  # a fresh order each epoch
    assert answers(RowStream(ListSource(n), seed=3).take(3 * n))[:2 * n + 2] == first + wrapped
    assert answers(RowStream(ListSource(n), seed=4).take(n)) != first


def test_stream_resume_continues_the_same_order():
    uninterrupted = answers(RowStream(ListSource(6), seed=11).take(10))
    stream = RowStream(ListSource(6), seed=11)
    head = answers(stream.take(5))
    state = json.loads(json.dumps(stream.state_dict()))  # the state is JSON-able
    resumed = RowStream(ListSource(6), seed=11)
    resumed.load_state_dict(state)
    assert head + answers(resumed.take(5)) == uninterrupted
    assert _error(lambda: RowStream(ListSource(7), seed=11).load_state_dict(state)) == \
        "resume: the data had 6 rows when saved and has 7 now; the saved position does not apply to changed data"
