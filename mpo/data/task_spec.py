"""What `data.task` names, decided from the string alone (config validation runs this before any process starts).

Three kinds:
  * "toy:reverse" / "toy:add": the built-in digit tasks in token space (mpo.data.toy);
  * "reasoning_gym:<task>[?size=N&seed=S]": procedural tasks from PyPI reasoning-gym, scored by their own scorer;
  * a .jsonl or .parquet file, a directory holding such files, or a glob of them.
"""

from __future__ import annotations

import glob
import os
import re
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


def _component_regex(part: str) -> str:
    """A regex for one glob path component: * and ? stay inside the component, [...] is a class, and (as in glob)
    a wildcard does not match a leading dot."""
    out, i = [] if part.startswith((".", "[.")) else [r"(?!\.)"], 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and "]" in part[i + 2:] + part[i + 1:i + 2].replace("]", ""):
            j = part.index("]", i + 2 if part[i + 1:i + 2] in ("!", "]") else i + 1)
            body = part[i + 1:j]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def safe_glob(pattern: str) -> list[str]:
    """`glob.glob(pattern, recursive=True)` that terminates on symlink loops.

    glob's ``**`` follows symlinked directories with no memory of where it has been: a link back to an ancestor
    (two of them make it exponential) walks until the path is too long, for hours. Here ``**`` walks the tree below
    the pattern's literal prefix once, following links but never entering a directory (device, inode) twice, and
    the paths are matched against the pattern. Patterns without ``**`` go to glob (their depth is fixed)."""
    if "**" not in pattern:
        return glob.glob(pattern)
    parts = pattern.split(os.sep)
    literal = next(i for i, p in enumerate(parts) if glob.has_magic(p))
    root = os.sep.join(parts[:literal]) or ("." if not pattern.startswith(os.sep) else os.sep)
    body = [r"(?:(?!\.)[^/]*/)*" if p == "**" else _component_regex(p) + "/" for p in parts[literal:]]
    if parts[-1] == "**":  # a final ** matches every path below, files included
        body[-1] = r"(?!\.)[^/]*(?:/(?!\.)[^/]*)*/"
    tail = "".join(body)
    tail = tail[:-1] if tail.endswith("/") else tail
    prefix = "" if not parts[:literal] else re.escape(os.sep.join(parts[:literal]) + os.sep)  # "/" for /**/x.jsonl
    regex = re.compile(prefix + tail + r"\Z", re.DOTALL)
    if not os.path.isdir(root):
        return []
    seen: set[tuple[int, int]] = set()
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name) if root != "." or parts[:literal] else os.path.relpath(
                os.path.join(dirpath, name))
            if regex.match(path):
                out.append(path)
    return out


def _has_data_files(task: str) -> bool:
    """Whether the reader (mpo.data.sources._expand_files) finds a data file: it walks directories recursively and
    expands `**` in globs; stops at the first file found."""
    path = Path(task)
    if path.is_dir():
        return any(p.suffix in DATA_SUFFIXES and p.is_file() for p in path.rglob("*"))
    if path.is_file():
        return path.suffix in DATA_SUFFIXES
    return any(Path(p).suffix in DATA_SUFFIXES and Path(p).is_file() for p in safe_glob(task))


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
