"""A progress bar on stderr (tqdm when installed, else a plain counter line)."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], *, total: int | None = None, desc: str = "", enabled: bool = True) -> Iterator[T]:
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the venv
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
        return
    for i, item in enumerate(items, 1):
        if i == 1 or i == total or i % 100 == 0:
            print(f"\r{desc}: {i}/{total or '?'}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr)
