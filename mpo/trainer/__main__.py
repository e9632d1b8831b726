"""`python -m mpo.trainer --config FILE [section.field=value ...]`: one trainer rank (start it with torchrun)."""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.trainer", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config (see mpo.config.TrainConfig)")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from mpo.config import load_config
    from mpo.trainer.loop import run

    run(load_config(args.config, args.overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
