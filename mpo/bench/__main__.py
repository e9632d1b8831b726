"""`python -m mpo.bench NAME [args]` runs mpo.bench.NAME.main(args)."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import mpo.bench


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(mpo.bench.__path__) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] not in names:
        print(f"usage: python -m mpo.bench {{{','.join(names)}}} [args]", file=sys.stderr)
        return 2
    return importlib.import_module(f"mpo.bench.{argv[0]}").main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
