"""`python -m mpo.trainer --config FILE [section.field=value ...]`: one trainer rank (start it with torchrun)."""

from __future__ import annotations

from mpo.lifecycle import exit_with_parent

if __name__ == "__main__":
    exit_with_parent()  # before the heavy imports: a rank must not outlive torchrun, even while it loads

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from mpo.lifecycle import REPORTED_FAILURE_EXIT, NoSpaceLeft, peer_reported_failure, stop_rank_with_one_line  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.trainer", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config (see mpo.config.TrainConfig)")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from mpo.config import load_config
    from mpo.trainer.loop import run

    try:
        run(load_config(args.config, args.overrides))
    except NoSpaceLeft as exc:  # the last complete checkpoint is still selected: the run can resume once there is room
        stop_rank_with_one_line(str(exc))
    except Exception:
        if peer_reported_failure():  # our error is that rank leaving; its one line is the run's
            os._exit(REPORTED_FAILURE_EXIT)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
