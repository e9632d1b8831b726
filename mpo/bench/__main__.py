"""Dispatch ``python -m mpo.bench NAME [args...]`` to ``mpo.bench.NAME.main(args)``."""

from __future__ import annotations

import importlib
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m mpo.bench NAME [args...]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"mpo.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
