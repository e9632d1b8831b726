"""Prompt rows from jsonl / parquet files (a file, a directory or a glob) or a reasoning-gym generator, read lazily.

A row has a `prompt` (a string) or `messages` (a chat list of {role, content}) plus an `answer`; every other key is
passed through as `metadata`. Sources give random access by index without holding the rows in memory:

* jsonl: one streaming scan at open records the byte offset of each non-blank line (8 bytes a row, a numpy int64
  array); `row(i)` seeks and parses that one line. The scan checks only that each line starts with `{` (cheap, vectorised);
  the JSON itself and the keys are validated when the row is read, so a bad line fails with its file and line when the
  stream reaches it. Whitespace-only lines are skipped (they are not rows) but line numbers stay the file's own. The
  scan reads each byte once whatever the line lengths (a line spanning many chunks is not re-joined), and a line over
  `max_row_bytes` is not a row: it is skipped and counted (`skipped_long`), never read whole.
* parquet: the footer gives the row count per row group; `row(i)` decodes the one row group that holds it into a
  process-wide LRU of a few groups. Decoding a group costs ~10 ms, so RowStream walks parquet in a block shuffle
  (stream.py) that decodes each group once an epoch. Columns are checked at open.
* `reasoning_gym:<task>[?size=N&seed=S]`: reasoning-gym builds entry i on demand from (seed, i); defaults
  size=10000, seed=0. The whole entry goes to metadata["reasoning_gym"] (the scorer needs it).

Every data problem raises :class:`DataError` with one line ``FILE:LINE: what is wrong`` (``FILE:row N`` for parquet,
0-based row index in that file).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl

import numpy as np

from .task_spec import DATA_SUFFIXES, safe_glob

REASONING_GYM_PREFIX = "reasoning_gym:"
REASONING_GYM_DEFAULT_SIZE = 10_000
_SCAN_CHUNK = 1 << 22  # 4 MiB: the jsonl scan's memory is this plus the offsets, whatever the file size
MAX_ROW_BYTES = 16 << 20  # a jsonl line longer than this is skipped: ~4M tokens, far past any model's context
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[list(b" \t\r\n\x0b\x0c")] = True  # what bytes.strip() strips


class DataError(ValueError):
    """A problem with the training data, as one line naming the file, the line (or row) and the key."""


@dataclass(frozen=True)
class Row:
    """One prompt: `prompt` (plain text) and/or `messages` (a chat; used when both are set), the reference
    `answer`, the other keys.

    `source` says where it came from: "path:line" (1-based line in a jsonl file), "path:row N" (0-based row in a
    parquet file) or "reasoning_gym:task#index".
    """

    prompt: str | None
    messages: tuple[dict, ...] | None
    answer: Any
    metadata: dict = field(default_factory=dict)
    source: str = ""


class RowSource(Protocol):
    """Random access to rows: `len(source)` rows, `source.row(i)` for 0 <= i < len."""

    def __len__(self) -> int: ...

    def row(self, index: int) -> Row: ...


@dataclass(frozen=True)
class Keys:
    """Which keys of a record hold the prompt, the chat messages and the answer."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = "messages"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_text(value: str, where: str, key: str) -> None:
    """A lone surrogate (JSON allows "\\ud800") cannot be encoded for the tokenizer or the engine: fail here."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{where}: key {key} is not valid UTF-8 text ({e.reason} at character {e.start})") from None


def _make_row(record: Any, keys: Keys, where: str) -> Row:
    """Validate one record (a decoded JSON object or parquet row) into a Row; `where` is "FILE:LINE"."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with keys {keys.prompt!r}/{keys.messages!r} and "
                        f"{keys.answer!r}, got {_type_name(record)}")
    present = sorted(record)
    prompt = record.get(keys.prompt)
    messages = record.get(keys.messages)
    if prompt is None and messages is None:
        if keys.prompt in record:  # a null cell: parquet columns exist for every row
            raise DataError(f"{where}: key {keys.prompt!r} is null (and no {keys.messages!r})")
        if keys.messages in record:
            raise DataError(f"{where}: key {keys.messages!r} is null (and no {keys.prompt!r})")
        raise DataError(f"{where}: missing key {keys.prompt!r} (or {keys.messages!r}); keys present: {present}")
    if prompt is not None and not isinstance(prompt, str):
        raise DataError(f"{where}: key {keys.prompt!r} must be a string, got {_type_name(prompt)}")
    if prompt is not None:
        _check_text(prompt, where, repr(keys.prompt))
    chat = None
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: key {keys.messages!r} must be a non-empty list of "
                            f"{{role, content}} objects, got {_type_name(messages)}")
        for k, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: key {keys.messages!r}[{k}] must be an object with string 'role' and "
                                f"'content', got {json.dumps(m, default=str)[:80]}")
            _check_text(m["role"] + m["content"], where, f"{keys.messages!r}[{k}]")
        chat = tuple(messages)
    if keys.answer not in record:
        raise DataError(f"{where}: missing key {keys.answer!r}; keys present: {present}")
    answer = record[keys.answer]
    if answer is None:
        raise DataError(f"{where}: key {keys.answer!r} is null")
    if isinstance(answer, str):
        _check_text(answer, where, repr(keys.answer))
    used = {keys.prompt, keys.messages, keys.answer}
    metadata = {k: v for k, v in record.items() if k not in used}
    return Row(prompt=prompt, messages=chat, answer=answer, metadata=metadata, source=where)


class JsonlSource:
    """A jsonl file read lazily through a byte-offset index (see the module doc: `max_row_bytes`, `skipped_long`)."""

    def __init__(self, path: str | Path, keys: Keys = Keys(), *, max_row_bytes: int = MAX_ROW_BYTES) -> None:
        self.path = str(path)
        self.keys = keys
        self.max_row_bytes = max_row_bytes
        self.skipped_long = 0
        self.first_skipped: str | None = None  # "path:line" of the first line skipped for its length
        self._offsets, self._lines = self._scan()
        if len(self._offsets) == 0:
            what = f" ({self.skipped_long} lines over {max_row_bytes} bytes skipped)" if self.skipped_long else ""
            raise DataError(f"{self.path}:1: empty file (no rows){what}")
        self._file = None

    def _line_is_row(self, line: int, length: int, first: int | None, preview: bytes) -> bool:
        """The scan's verdict on one line: a row (True), blank or too long (False), or not an object (raises)."""
        if first is None:
            return False
        if first != ord("{"):
            text = preview.split(b"\n")[0].rstrip().decode("utf-8", "replace")
            raise DataError(f"{self.path}:{line}: invalid JSON: a row must be a JSON object, got {text[:40]!r}")
        if length > self.max_row_bytes:
            self.skipped_long += 1
            if self.first_skipped is None:
                self.first_skipped = f"{self.path}:{line}"
            return False
        return True

    @staticmethod
    def _first_text(buf: np.ndarray) -> int | None:
        """Index of the first non-whitespace byte of `buf`, or None."""
        if len(buf) == 0:
            return None
        k = int(np.argmin(_WHITESPACE[buf]))
        return None if _WHITESPACE[buf[k]] else k

    def _scan(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Offsets of the rows; their 1-based line numbers only when skipped lines made them differ. A line that
        spans chunks is tracked by its start, length and first non-whitespace byte (and a few bytes for the error
        message), never joined into one buffer."""
        offsets: list[np.ndarray] = []
        lines: list[np.ndarray] = []
        dense = True  # every line so far was a row: row i is line i + 1, and no line numbers need keeping
        n_rows = 0
        line_no = 0  # complete lines before the current one
        base = 0  # file offset of the current chunk's first byte
        cur_start, cur_len, cur_first, cur_preview = 0, 0, None, b""  # the unfinished line

        def add(offs: np.ndarray, nums: np.ndarray) -> None:
            nonlocal dense, n_rows
            if dense and not np.array_equal(nums, np.arange(n_rows + 1, n_rows + 1 + len(nums))):
                dense = False
                lines.append(np.arange(1, n_rows + 1, dtype=np.int64))
            offsets.append(offs.astype(np.int64))
            if not dense:
                lines.append(nums.astype(np.int64))
            n_rows += len(offs)

        with open(self.path, "rb") as f:
            if f.read(3) == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark is not part of the first row
                base = cur_start = 3
            f.seek(base)
            while True:
                chunk = f.read(_SCAN_CHUNK)
                if not chunk:  # end of file: the last line need not end in a newline
                    if self._line_is_row(line_no + 1, cur_len, cur_first, cur_preview):
                        add(np.array([cur_start]), np.array([line_no + 1]))
                    break
                buf = np.frombuffer(chunk, dtype=np.uint8)
                ends = np.flatnonzero(buf == 0x0A)
                head = buf[:ends[0]] if len(ends) else buf  # the unfinished line goes on
                if cur_first is None:
                    k = self._first_text(head)
                    if k is not None:
                        cur_first, cur_preview = int(head[k]), bytes(chunk[k:k + 40])
                cur_len += len(head)
                if not len(ends):
                    base += len(chunk)
                    continue
                if self._line_is_row(line_no + 1, cur_len, cur_first, cur_preview):
                    add(np.array([cur_start]), np.array([line_no + 1]))
                line_no += 1
                # The lines wholly inside this chunk, vectorised: most start with "{" and are short.
                starts, stops = ends[:-1] + 1, ends[1:]
                lengths = stops - starts
                first = buf[np.minimum(starts, len(buf) - 1)]
                keep = (lengths > 0) & (first == ord("{"))
                odd = np.flatnonzero((lengths > 0) & (first != ord("{")))
                for k in odd:  # rare: leading whitespace, a blank line, or not an object
                    seg = buf[starts[k]:stops[k]]
                    j = self._first_text(seg)
                    keep[k] = j is not None and self._line_is_row(
                        line_no + k + 1, 0, int(seg[j]), bytes(chunk[starts[k] + j:starts[k] + j + 40]))
                long = keep & (lengths > self.max_row_bytes)
                for k in np.flatnonzero(long):
                    self._line_is_row(line_no + k + 1, int(lengths[k]), ord("{"), b"")
                keep &= ~long
                add(starts[keep] + base, np.flatnonzero(keep) + line_no + 1)
                line_no += len(starts)
                # The tail after the last newline starts the next unfinished line.
                cur_start = base + int(ends[-1]) + 1
                tail = buf[int(ends[-1]) + 1:]
                cur_len = len(tail)
                k = self._first_text(tail)
                cur_first = None if k is None else int(tail[k])
                cur_preview = b"" if k is None else bytes(chunk[int(ends[-1]) + 1 + k:int(ends[-1]) + 41 + k])
                base += len(chunk)
        flat = np.concatenate(offsets) if offsets else np.zeros(0, np.int64)
        return flat, (None if dense else np.concatenate(lines))

    def __len__(self) -> int:
        return len(self._offsets)

    def line_number(self, index: int) -> int:
        return int(self._lines[index]) if self._lines is not None else index + 1

    def row(self, index: int) -> Row:
        where = f"{self.path}:{self.line_number(index)}"
        if self._file is None:
            self._file = open(self.path, "rb")
        self._file.seek(int(self._offsets[index]))
        raw = self._file.readline().rstrip(b"\r\n")
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e.msg} at column {e.colno}") from None
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: invalid JSON: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except RecursionError:
            raise DataError(f"{where}: invalid JSON: nested too deeply") from None
        except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
            raise DataError(f"{where}: invalid JSON: {str(e).split(';')[0]}") from None
        return _make_row(record, self.keys, where)

    def __getstate__(self) -> dict:  # picklable: the open file is reopened on first use
        return {**self.__dict__, "_file": None}

    def release(self) -> None:
        """Close the file handle (reopened on the next read)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class _GroupCache:
    """Decoded parquet row groups, least recently used first out, shared by every ParquetSource of the process so
    that a directory of thousands of files holds at most `capacity` groups, not a few per file."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tables: OrderedDict[tuple[str, int], Any] = OrderedDict()

    def get(self, key: tuple[str, int], load) -> Any:
        if key in self._tables:
            self._tables.move_to_end(key)
            return self._tables[key]
        table = load()
        self._tables[key] = table
        while len(self._tables) > self.capacity:
            self._tables.popitem(last=False)
        return table

    def __len__(self) -> int:
        return len(self._tables)


# RowStream's block shuffle (stream.py) walks DEFAULT_BLOCK_WINDOW row groups at a time: the cache holds them all.
PARQUET_CACHE_GROUPS = 6
GROUP_CACHE = _GroupCache(PARQUET_CACHE_GROUPS)


class ParquetSource:
    """A parquet file read one row group at a time (see the module doc)."""

    def __init__(self, path: str | Path, keys: Keys = Keys()) -> None:
        import pyarrow.parquet as pq

        self.path = str(path)
        self.keys = keys
        try:
            pf = pq.ParquetFile(self.path)
            meta = pf.metadata
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for non-parquet bytes
            raise DataError(f"{self.path}: not a readable parquet file: {str(e).splitlines()[0]}") from None
        columns = pf.schema_arrow.names  # top-level columns (meta.schema lists nested leaves)
        if keys.prompt not in columns and keys.messages not in columns:
            raise DataError(f"{self.path}: missing column {keys.prompt!r} (or {keys.messages!r}); "
                            f"columns present: {sorted(columns)}")
        if keys.answer not in columns:
            raise DataError(f"{self.path}: missing column {keys.answer!r}; columns present: {sorted(columns)}")
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._ends = np.cumsum(sizes, dtype=np.int64)
        if len(self) == 0:
            raise DataError(f"{self.path}:row 0: empty file (no rows)")
        self._pf = None

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def block_ends(self) -> np.ndarray:
        """Cumulative row counts of the row groups: RowStream shuffles whole groups, then rows inside a few."""
        return self._ends

    def _load(self, g: int):
        if self._pf is None:
            import pyarrow.parquet as pq

            self._pf = pq.ParquetFile(self.path)
        return self._pf.read_row_group(g)

    def _group(self, g: int, index: int):
        try:
            return GROUP_CACHE.get((self.path, g), lambda: self._load(g))
        except Exception as e:  # pyarrow: OSError / ArrowInvalid for a page that does not decode
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{self.path}:row {index}: cannot read row group {g} (corrupt file?): {first}") from None

    def release(self) -> None:
        self._pf = None

    def row(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.path}: row {index} out of range (0..{len(self) - 1})")
        g = int(np.searchsorted(self._ends, index, side="right"))
        start = int(self._ends[g - 1]) if g else 0
        record = self._group(g, index).slice(index - start, 1).to_pylist()[0]
        return _make_row(record, self.keys, f"{self.path}:row {index}")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pf": None}


class ConcatSource:
    """Several sources as one, in the given order. Only the last-read file stays open (thousands of shards must not
    hold thousands of file handles)."""

    def __init__(self, sources: list[RowSource]) -> None:
        self.sources = sources
        self._ends = np.cumsum([len(s) for s in sources], dtype=np.int64)
        self._open: int | None = None

    def block_ends(self) -> np.ndarray | None:
        """The parts' row groups in one index space when every part has them (all parquet), else None."""
        parts = [getattr(s, "block_ends", None) for s in self.sources]
        if any(p is None for p in parts):
            return None
        starts = np.concatenate(([0], self._ends[:-1]))
        return np.concatenate([p() + start for p, start in zip(parts, starts)])

    def __len__(self) -> int:
        return int(self._ends[-1])

    def row(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range (0..{len(self) - 1})")
        k = int(np.searchsorted(self._ends, index, side="right"))
        if self._open is not None and self._open != k:
            getattr(self.sources[self._open], "release", lambda: None)()
        self._open = k
        return self.sources[k].row(index - (int(self._ends[k - 1]) if k else 0))


class ReasoningGymSource:
    """Entries of a reasoning-gym procedural dataset, generated on demand (entry i is a function of seed and i)."""

    def __init__(self, spec: str) -> None:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        name, _, query = spec[len(REASONING_GYM_PREFIX):].partition("?")
        if name not in DATASETS:
            close = [n for n in sorted(DATASETS) if n[:3] == name[:3]] or sorted(DATASETS)
            raise DataError(f"{spec}: unknown reasoning_gym task {name!r}; valid names include: "
                            f"{', '.join(close[:8])} ... ({len(DATASETS)} tasks)")
        params = {"size": REASONING_GYM_DEFAULT_SIZE, "seed": 0}
        for key, value in parse_qsl(query, keep_blank_values=True):
            if key not in params:
                raise DataError(f"{spec}: unknown option {key!r}; valid: size, seed")
            try:
                params[key] = int(value)
            except ValueError:
                raise DataError(f"{spec}: option {key}={value!r} must be an integer") from None
        if params["size"] < 1:
            raise DataError(f"{spec}: option size={params['size']} must be >= 1")
        self.name = name
        try:
            self.dataset = reasoning_gym.create_dataset(name, size=params["size"], seed=params["seed"])
        except Exception as e:  # the task's own config validation (AssertionError, ValueError, ...)
            raise DataError(f"{spec}: reasoning_gym could not build {name!r}: {e}") from None

    def __len__(self) -> int:
        return len(self.dataset)

    def row(self, index: int) -> Row:
        entry = self.dataset[index]
        return Row(prompt=entry["question"], messages=None, answer=entry["answer"],
                   metadata={"reasoning_gym": entry}, source=f"{REASONING_GYM_PREFIX}{self.name}#{index}")


def _expand_files(task: str) -> list[str]:
    path = Path(task)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"{task}: directory has no .jsonl or .parquet files")
        return files
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise DataError(f"{task}: unsupported file type {path.suffix!r}; valid: .jsonl, .parquet")
        return [task]
    if any(c in task for c in "*?["):
        files = sorted(f for f in safe_glob(task) if Path(f).suffix in DATA_SUFFIXES and os.path.isfile(f))
        if not files:
            raise DataError(f"{task}: no .jsonl or .parquet files match the glob")
        return files
    raise DataError(f"{task}: no such file or directory")


def open_source(task: str, *, prompt_key: str = "prompt", answer_key: str = "answer",
                messages_key: str = "messages", max_row_bytes: int = MAX_ROW_BYTES) -> RowSource:
    """The rows of `task`: a .jsonl / .parquet file, a directory of them (recursive, sorted), a glob, or
    ``reasoning_gym:<task>[?size=N&seed=S]``. The key arguments rename the prompt / answer / messages fields;
    jsonl lines over `max_row_bytes` are skipped (see `skipped_rows`)."""
    if task.startswith(REASONING_GYM_PREFIX):
        return ReasoningGymSource(task)
    keys = Keys(prompt=prompt_key, answer=answer_key, messages=messages_key)
    sources: list[RowSource] = [
        ParquetSource(f, keys) if f.endswith(".parquet") else JsonlSource(f, keys, max_row_bytes=max_row_bytes)
        for f in _expand_files(task)]
    return sources[0] if len(sources) == 1 else ConcatSource(sources)


PEEK_ROWS = 16  # rows check_first_rows reads: enough that one bad row does not refuse a good file


def check_first_rows(task: str, *, prompt_key: str = "prompt", answer_key: str = "answer",
                     messages_key: str = "messages", max_row_bytes: int = MAX_ROW_BYTES) -> None:
    """Before any process starts: DataError (the first row's) when none of the first PEEK_ROWS rows of `task`'s first
    file is usable, e.g. the answer is under another key in every row. A few bad rows among good ones pass (the run
    skips and counts those). Reads only the start of the first file: no index of a large dataset is built here."""
    if task.startswith(REASONING_GYM_PREFIX):
        return
    keys = Keys(prompt=prompt_key, answer=answer_key, messages=messages_key)
    first = _expand_files(task)[0]
    if first.endswith(".parquet"):
        ParquetSource(first, keys)  # its columns are checked from the footer
        return
    errors: list[str] = []
    with open(first, "rb") as handle:
        number = 0
        while len(errors) < PEEK_ROWS:
            raw = handle.readline(max_row_bytes + 1)  # bounded: a huge line is skipped, never held (as the index)
            if not raw:
                break
            number += 1
            if len(raw) > max_row_bytes:
                while raw and not raw.endswith(b"\n"):
                    raw = handle.readline(1 << 20)
                continue
            if not raw.strip():
                continue
            where = f"{first}:{number}"
            try:
                _make_row(json.loads(raw), keys, where)
                return
            except json.JSONDecodeError as e:
                errors.append(f"{where}: invalid JSON: {e.msg}")
            except (DataError, RecursionError, UnicodeDecodeError) as e:
                errors.append(str(e) if isinstance(e, DataError) else f"{where}: {type(e).__name__}")
    if errors:
        more = f"; none of the first {len(errors)} rows is usable" if len(errors) > 1 else ""
        raise DataError(f"{errors[0]}{more}")


def skipped_rows(source: RowSource) -> tuple[int, str | None]:
    """(jsonl lines skipped for their length, where the first was) over `source` and its parts."""
    parts = getattr(source, "sources", [source])
    count = sum(getattr(p, "skipped_long", 0) for p in parts)
    first = next((p.first_skipped for p in parts if getattr(p, "first_skipped", None)), None)
    return count, first
