"""Run a function on N real gloo ranks (separate processes), as torchrun would.

The ranks start from a fork server that has imported torch, megatron-core, transformers and mpo's model and trainer
modules once (multiprocessing's "forkserver", with a preload list): a rank is a fork of it, not a fresh interpreter
that imports ~2.5 s of modules again. Each rank is still a process of its own that has run no torch or gloo code
before its function (the server only imports; nothing in it has made threads or process groups), and it runs with
the caller's environment and standard output and error as they are now (the server's are from when it started: the
first caller's, e.g. another test's captured output), as a spawned rank would.
"""

from __future__ import annotations

import os
from multiprocessing import reduction
from typing import Any, Callable

import torch.multiprocessing as mp

from mpo.parallel.ports import free_port

# What most ranks import (a rank imports the rest itself). Imported in the server only, never here.
PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
           "megatron.core.transformer.moe.moe_layer", "megatron.core.optimizer", "megatron.core.dist_checkpointing",
           "megatron.core.distributed", "megatron.core.pipeline_parallel", "transformers",
           "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "mpo.models.builder", "mpo.models.forward", "mpo.parallel.init", "mpo.trainer.loop"]


class _CallerFd:
    """One of the caller's file descriptors, handed to the rank over the fork server's socket (SCM_RIGHTS) when the
    rank's arguments are pickled; unpickles as the rank's own descriptor for the same open file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(handle) -> int:
    return handle.detach()


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, env: dict[str, str],
           stdio: tuple[int, int], args: tuple) -> None:
    for fd, caller in zip((1, 2), stdio):  # the caller's stdout and stderr (under pytest: this test's capture)
        os.dup2(caller, fd)
        os.close(caller)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    fn(*args)


def spawn_ranks(world_size: int, fn: Callable[..., None], *args: Any) -> None:
    """Start `world_size` processes running fn(*args) with torchrun's environment; raise if any fails."""
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts (first call)
    stdio = (_CallerFd(1), _CallerFd(2))
    mp.start_processes(_entry, args=(fn, world_size, free_port(), dict(os.environ), stdio, args), nprocs=world_size,
                       join=True, start_method="forkserver")
