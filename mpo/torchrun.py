"""`python -m mpo.torchrun [torchrun args]`: torchrun that dies with its launcher and ends a run with one line.

- It dies with the process that started it (mpo.lifecycle.exit_with_parent), and its ranks with it: it hands them
  its own pid in MPO_PARENT (torchrun copies its environment into every rank's), and each rank sets a death signal
  toward it first thing (mpo/trainer/__main__.py). torchrun puts every rank in its own session, so without this a
  kill of the launcher's process group left the ranks running.
- Ctrl-C (or SIGTERM) stops the ranks and exits 130 without torchrun's traceback; `mpo train` prints the one line.
- A rank that stops on a failure it describes in one line (mpo.lifecycle.stop_rank_with_one_line, e.g. a full disk)
  leaves that line in torchrun's error file; this prints it once, instead of torchrun's failure report.
"""

from __future__ import annotations

import sys

from mpo.lifecycle import child_env, exit_with_parent, one_line_failure

# torchrun's loggers that report a failed worker and the stopping of the others (held back until we know whether
# the failure was a one-line one).
_FAILURE_LOGGERS = ("torch.distributed.elastic.multiprocessing", "torch.distributed.elastic.agent")


def main(argv: list[str]) -> int:
    exit_with_parent()
    import logging
    import os

    os.environ.update(child_env())  # torchrun forks the ranks from this (main) thread: they may use the signal
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.name.startswith(_FAILURE_LOGGERS) and record.levelno >= logging.WARNING:
            held.append(record)
            return False
        return True

    handlers = [h for name in ("", "torch", "torch.distributed", "torch.distributed.elastic", *_FAILURE_LOGGERS)
                for h in logging.getLogger(name).handlers]
    for handler in handlers:
        handler.addFilter(hold)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    line = None
    try:
        torchrun_main(argv)
    except (SignalException, KeyboardInterrupt):  # Ctrl-C or a kill: the ranks were stopped; `mpo` says so
        held.clear()
        return 130
    except ChildFailedError as exc:
        reported = sorted((f.timestamp, rank, f.message) for rank, f in exc.failures.items()
                          if one_line_failure(f.message))
        if not reported:
            raise
        line = reported[0][2]
    finally:
        for handler in handlers:
            handler.removeFilter(hold)
        if line is None:  # not a one-line failure: torchrun's own report, as it would have printed it
            for record in held:
                logging.getLogger(record.name).handle(record)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
