"""megatron-core DistributedDataParallel around the model, with the hooks its schedules expect."""

from __future__ import annotations

import torch


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool = False) -> torch.nn.Module:
    """Wrap in megatron DDP (fp32 grad buffers) and register finalize_model_grads with the schedules.

    finalize_model_grads reduces gradients over data parallel ranks and all-reduces the gradients of
    sequence-parallel-replicated parameters (norms, router) over TP, which megatron's schedules call after the last
    micro-batch's backward.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    config = model.config
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=distributed_optimizer),
        module=model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp


def is_ddp(model: torch.nn.Module) -> bool:
    from megatron.core.distributed import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)
