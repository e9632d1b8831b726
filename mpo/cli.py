"""The `mpo` command. Subcommands arrive with their issues; `mpo --help` lists what exists."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpo", description="RL for Mixture-of-Experts LLMs on megatron-core + SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run a benchmark: mpo bench NAME [args] (same as python -m mpo.bench)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from mpo.bench.__main__ import main as bench_main

        return bench_main(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
