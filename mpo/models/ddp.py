"""megatron-core DistributedDataParallel around the model, with the hooks its schedules expect."""

from __future__ import annotations

import torch


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool = False) -> torch.nn.Module:
    """Wrap in megatron DDP (fp32 grad buffers) and register finalize_model_grads with the schedules.

    finalize_model_grads reduces gradients over data parallel ranks and all-reduces the gradients of
    sequence-parallel-replicated parameters (norms, router) over TP, which megatron's schedules call after the last
    micro-batch's backward.

    Under virtual pipeline parallelism (a ModelChunks) each chunk gets its own DDP, as megatron training does; the
    schedules then take one no_sync per chunk.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from mpo.models.chunks import ModelChunks, as_chunks

    config = model.config
    ddps = [DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=distributed_optimizer),
        module=chunk,
        # megatron: only the first chunk's buffers are bucketed (the others are reduced in one go)
        disable_bucketing=index > 0,
    ) for index, chunk in enumerate(as_chunks(model))]
    config.finalize_model_grads_func = finalize_model_grads
    if len(ddps) == 1:
        config.no_sync_func = ddps[0].no_sync
        return ddps[0]
    config.no_sync_func = [ddp.no_sync for ddp in ddps]
    return ModelChunks(ddps)


def is_ddp(model: torch.nn.Module) -> bool:
    from megatron.core.distributed import DistributedDataParallel

    from mpo.models.chunks import as_chunks

    return isinstance(as_chunks(model)[0], DistributedDataParallel)
