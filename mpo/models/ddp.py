"""megatron-core DistributedDataParallel around the model, with the hooks its schedules expect."""

from __future__ import annotations

from typing import Any

import torch


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool = False,
             overlap_grad_reduce: bool = False) -> torch.nn.Module:
    """Wrap in megatron DDP (fp32 grad buffers) and register finalize_model_grads with the schedules.

    distributed_optimizer: grads are reduce-scattered (not all-reduced) into the DistributedOptimizer's shards; the
    optimizer must then be built with `use_distributed_optimizer` too. overlap_grad_reduce: each bucket's reduce
    starts while the backward still runs (CUDA streams; GPU only). The param all-gather is not overlapped: the RL loop
    pushes the new weights to the engines right after every optimizer step, so there is no next forward to hide the
    gather behind, and megatron's overlapped gather would leave the parameters stale until one runs.

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
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
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


def make_optimizer(ddp_model: torch.nn.Module, *, lr: float, clip_grad: float, bf16: bool, min_lr: float | None = None,
                   weight_decay: float = 0.0, adam_beta1: float = 0.9, adam_beta2: float = 0.999,
                   adam_eps: float = 1e-8):
    """megatron Adam over a model from wrap_ddp: the DistributedOptimizer when the DDP wrapper reduce-scatters grads
    (use_distributed_optimizer), else the plain one. One place, so the policy and the critic agree. Under VPP it
    takes every model chunk. Weight decay applies to matrices only (megatron's parameter groups exempt biases and
    norms); lr and weight decay over time are mpo.trainer.lr_schedule's."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mpo.models.chunks import as_chunks
    from mpo.models.multi_tensor import use_foreach_multi_tensor

    use_foreach_multi_tensor()  # without TE or apex: clipping's norm and scale without a Python call per tensor

    chunks = as_chunks(ddp_model)
    distributed = chunks[0].ddp_config.use_distributed_optimizer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr, clip_grad=clip_grad, bf16=bf16,
                        weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps,
                        use_distributed_optimizer=distributed), chunks)
    # torch's Adam (megatron's optimizer without TE or apex) takes its per-tensor Python loop unless every parameter
    # is on CUDA; its foreach kernels give the same numbers bit for bit (checked on the tiny model's 159 tensors)
    # in a third less time on the CPU, where the loop was most of the optimizer step.
    for inner in inner_optimizers(optimizer):
        if isinstance(inner, torch.optim.Optimizer):
            for group in inner.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True
    return optimizer


def inner_optimizers(optimizer: Any) -> list:
    """The torch optimizers behind a megatron (chained) optimizer."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def ddp_options(parallel, device) -> dict[str, bool]:
    """wrap_ddp's switches for a layout (mpo.parallel.ParallelConfig) on a device (DeviceProfile): the distributed
    optimizer as configured (default: on with CUDA), and the overlapped grad reduce with it on GPU only (it runs the
    reduce on a side CUDA stream)."""
    distributed = parallel.use_distributed_optimizer(device.is_gpu)
    return {"distributed_optimizer": distributed, "overlap_grad_reduce": distributed and device.is_gpu}
