"""Shared set-up for benchmarks that run megatron in this one process."""

from __future__ import annotations

import os
import socket


def init_single_rank():
    """Initialise a one-rank world (gloo on CPU) for benchmarks."""
    from mpo.parallel import ParallelConfig, initialize_parallel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("MASTER_PORT", str(port))
    return initialize_parallel(ParallelConfig(), rank=0, world_size=1)
