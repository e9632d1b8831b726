"""Run a function on N real gloo ranks (separate processes), as torchrun would."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.multiprocessing as mp

from mpo.parallel.ports import free_port


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    fn(*args)


def spawn_ranks(world_size: int, fn: Callable[..., None], *args: Any) -> None:
    """Start `world_size` processes running fn(*args) with torchrun's environment; raise if any fails."""
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True,
                       start_method="spawn")
