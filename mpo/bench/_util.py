"""Shared set-up for benchmarks that run megatron in this one process."""

from __future__ import annotations


def init_single_rank():
    """Initialise a one-rank world (gloo on CPU) for benchmarks."""
    from mpo.parallel import ParallelConfig, initialize_parallel

    return initialize_parallel(ParallelConfig(), rank=0, world_size=1)
