"""`python -m mpo.trainer --config FILE [section.field=value ...]`: one trainer rank (start it with torchrun)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from mpo.lifecycle import (
    REPORTED_FAILURE_EXIT,
    NoSpaceLeft,
    exit_with_parent,
    first_no_space,
    peer_reported_failure,
    quiet_no_space_in_threads,
    stop_rank_with_one_line,
)

if __name__ == "__main__":
    exit_with_parent()  # before torch is imported: a rank must not outlive torchrun, even while it loads

import torch  # noqa: E402
from mpo.parallel.device import skip_torch_compile_without_gpu  # noqa: E402

PEER_REPORT_GRACE_S = 10.0  # how long a failing rank waits for a peer's one-line report before its own traceback


def _note_interrupts() -> threading.Event:
    """SIGINT raises KeyboardInterrupt as before, and is also noted: a library may catch it and raise its own error
    instead (megatron's checkpoint writer turns it into a CheckpointException), which is still a Ctrl-C."""
    interrupted = threading.Event()

    def on_sigint(signum, frame):
        interrupted.set()
        signal.default_int_handler(signum, frame)

    if threading.current_thread() is threading.main_thread():  # only the main thread may set a handler
        signal.signal(signal.SIGINT, on_sigint)
    return interrupted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.trainer", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config (see mpo.config.TrainConfig)")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    interrupted = _note_interrupts()
    torch.set_num_threads(1)
    skip_torch_compile_without_gpu()
    quiet_no_space_in_threads()
    from mpo.config import ConfigError
    from mpo.config_checks import load_config
    from mpo.data.sources import DataError
    from mpo.rollout.pool import rollout_failure
    from mpo.trainer.dist_checkpoint import CheckpointError
    from mpo.trainer.loop import run
    from mpo.trainer.producer import ProducerDied

    try:
        run(load_config(args.config, args.overrides))
    except NoSpaceLeft as exc:  # the last complete checkpoint is still selected: the run can resume once there is room
        stop_rank_with_one_line(str(first_no_space(exc)))
    except DataError as exc:  # a bad row names its file, line and key; the last checkpoint is intact
        stop_rank_with_one_line(f"data error: {exc}")
    except ConfigError as exc:  # found only here (e.g. a script's config with model.hf_dir and no weights)
        stop_rank_with_one_line(f"config error: {exc}")
    except CheckpointError as exc:  # nothing to resume from, and no silent restart either
        stop_rank_with_one_line(f"checkpoint error: {exc}")
    except ProducerDied as exc:  # the off-policy rollout process is gone: the run stops, resumable
        stop_rank_with_one_line(str(exc))
    except KeyboardInterrupt:  # Ctrl-C, forwarded by torchrun: checkpoints are atomic; `mpo train` says how to resume
        return 130
    except Exception as exc:
        if interrupted.is_set():  # Ctrl-C inside a library that wrapped it (a checkpoint write: megatron's worker)
            return 130
        failed = rollout_failure(exc)  # an engine failed past its retries (or refused a call): its one line
        if failed is not None:
            stop_rank_with_one_line(str(failed))
        # Our error may be a consequence of a peer's failure (its exit broke a collective, or a checkpoint write failed
        # on its disk): give that rank a moment to write its one line, which is then the run's.
        deadline = time.monotonic() + PEER_REPORT_GRACE_S
        while True:
            if peer_reported_failure():
                os._exit(REPORTED_FAILURE_EXIT)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    code = main()
    # The run is over: checkpoints written, engines stopped, logs closed, every rank past the last barrier. Skip the
    # interpreter's teardown of torch, megatron and gloo (seconds per rank on shared cores; torchrun waits for it).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
