"""One entry point that brings up torch.distributed and megatron-core's parallel_state for a layout."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mpo.parallel.config import ParallelConfig
from mpo.parallel.cpu_shims import apply_cpu_shims
from mpo.parallel.device import DeviceProfile, detect_device
from mpo.parallel.ports import free_port


@dataclass(frozen=True)
class ParallelContext:
    """What a rank knows about its place in the job after initialisation."""

    rank: int
    world_size: int
    local_rank: int
    parallel: ParallelConfig
    device: DeviceProfile
    shims: tuple[str, ...]
    object_group: dist.ProcessGroup | None = None  # gloo, every rank: object broadcasts and long waits (see below)

    @property
    def data_parallel(self) -> int:
        return self.parallel.data_parallel(self.world_size)


def launch_rank() -> int:
    """This process's global rank from torchrun's environment (RANK; a lone process is 0), readable before any process
    group exists."""
    return int(os.environ.get("RANK", 0))


def initialize_parallel(parallel: ParallelConfig, *, rank: int | None = None, world_size: int | None = None,
                        master_addr: str | None = None, master_port: int | None = None,
                        num_layers: int | None = None, num_attention_heads: int | None = None,
                        num_query_groups: int | None = None, num_experts: int | None = None,
                        seed: int = 1234, force_cpu: bool = False, timeout_s: float | None = None) -> ParallelContext:
    """Initialise torch.distributed (NCCL on GPU, gloo on CPU) and megatron-core's parallel_state.

    Rank and world size come from the arguments, else from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), else a single process. The layout is validated against the world size and, when given,
    the model's dimensions before any process group is created, so a bad layout fails with one clear line.
    Collectives time out after `timeout_s` (default: parallel.distributed_timeout_s).
    """
    rank = launch_rank() if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    parallel.validate(world_size, num_layers=num_layers, num_attention_heads=num_attention_heads,
                      num_query_groups=num_query_groups, num_experts=num_experts)

    timeout_s = parallel.distributed_timeout_s if timeout_s is None else timeout_s
    device = detect_device(local_rank, force_cpu=force_cpu)
    shims = tuple(apply_cpu_shims()) if not device.is_gpu else ()
    if device.is_gpu:
        torch.cuda.set_device(device.device)

    if not dist.is_initialized():
        # Explicit arguments win over torchrun's environment; a lone process defaults to localhost.
        os.environ["MASTER_ADDR"] = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        # A lone process with no rendezvous given picks a free port, so several can run side by side.
        os.environ["MASTER_PORT"] = str(master_port or os.environ.get("MASTER_PORT")
                                        or (free_port() if world_size == 1 else 29500))
        dist.init_process_group(backend=device.backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.etp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    # Python objects (rollout samples, probes, metrics) travel on a gloo group: pickles are host bytes, outside NCCL's
    # watchdog. On CPU the world group already is gloo. Ranks waiting for rank 0's rollouts (longer than timeout_s at
    # 32k tokens) do not wait in a receive of this group: they poll rank 0's announcements and heartbeat on the job's
    # store (mpo.trainer.distribute.RolloutWait) and receive once the samples are sent.
    object_group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                    if device.is_gpu and world_size > 1 else None)
    return ParallelContext(rank, world_size, local_rank, parallel, device, shims, object_group)


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
