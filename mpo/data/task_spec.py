"""What `data.task` names, decided from the string alone (config validation runs this before any process starts).

Three kinds:
  * "toy:reverse" / "toy:add": the built-in digit tasks in token space (mpo.data.toy);
  * "reasoning_gym:<task>[?size=N&seed=S]": procedural tasks from PyPI reasoning-gym, scored by their own scorer;
  * a .jsonl or .parquet file, a directory holding such files, or a glob of them.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TOY_TASKS = ("toy:reverse", "toy:add")
DATA_SUFFIXES = (".jsonl", ".parquet")


class TaskSpecError(ValueError):
    """data.task names nothing that can be read; the message is one line with the valid forms."""


@dataclass(frozen=True)
class TaskSpec:
    """A parsed data.task: its kind and the original string (what mpo.data.sources.open_source takes)."""

    kind: Literal["toy", "reasoning_gym", "files"]
    task: str


def _has_data_files(task: str) -> bool:
    """Whether the reader (mpo.data.sources._expand_files) finds a data file: it walks directories recursively and
    expands `**` in globs; stops at the first file found."""
    path = Path(task)
    if path.is_dir():
        return any(p.suffix in DATA_SUFFIXES and p.is_file() for p in path.rglob("*"))
    if path.is_file():
        return path.suffix in DATA_SUFFIXES
    return any(Path(p).suffix in DATA_SUFFIXES and Path(p).is_file() for p in glob.iglob(task, recursive=True))


def parse_task(task: str) -> TaskSpec:
    """Classify `task`; raises TaskSpecError naming the valid forms when it is none of them (or names no file)."""
    valid = "toy:reverse, toy:add, reasoning_gym:<task>[?size=N&seed=S], or a .jsonl/.parquet file, directory or glob"
    if task.startswith("toy:"):
        if task not in TOY_TASKS:
            raise TaskSpecError(f"{task!r}; valid toy tasks: {', '.join(TOY_TASKS)}")
        return TaskSpec("toy", task)
    if task.startswith("reasoning_gym:"):
        if not task.split(":", 1)[1].split("?", 1)[0]:
            raise TaskSpecError(f"{task!r} names no reasoning_gym task; e.g. reasoning_gym:basic_arithmetic")
        return TaskSpec("reasoning_gym", task)
    if not _has_data_files(task):
        what = "no such file or directory" if not any(c in task for c in "*?[") else "the glob matches no file"
        if Path(task).exists():
            what = f"not a {' or '.join(DATA_SUFFIXES)} file (or a directory holding some)"
        raise TaskSpecError(f"{task!r}: {what}; valid values: {valid}")
    return TaskSpec("files", task)
