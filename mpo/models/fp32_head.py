"""FP32 LM head: the output layer's weight, matmul and logits stay fp32 while the body runs in bf16.

megatron-core has no switch for this (Float16Module's fp32_output only upcasts *after* a bf16 matmul). We cast the
head's weight to fp32 and upcast its input with a forward pre-hook. The pre-hook runs before ColumnParallelLinear's
sequence-parallel all-gather, so it composes with TP/SP, and the head stays vocab-parallel. With tied embeddings the
shared bf16 embedding weight arrives as the `weight` argument; it is upcast for the matmul and its gradient flows back
to the bf16 embedding through the cast.
"""

from __future__ import annotations

from typing import Any

import torch


def _upcast_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    hidden = args[0].float() if args and torch.is_floating_point(args[0]) else args[0]
    if kwargs.get("weight") is not None:
        kwargs = {**kwargs, "weight": kwargs["weight"].float()}
    return (hidden, *args[1:]), kwargs


def _output_layer(model: Any) -> Any:
    """The head under DDP / Float16Module wrappers; None on a pipeline stage without one."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "output_layer", None)


def apply_fp32_lm_head(model: torch.nn.Module) -> bool:
    """Make the LM head fp32 on this rank (no-op on pipeline stages without a head). Returns whether a head was found.

    Call after any Float16Module wrapping. Idempotent.
    """
    head = _output_layer(model)
    if head is None:
        return False
    if getattr(head, "_mpo_fp32_head", False):
        return True
    if head.weight is not None:
        head.float()
    head.register_forward_pre_hook(_upcast_inputs, with_kwargs=True)
    head._mpo_fp32_head = True
    return True


def is_fp32_lm_head(model: Any) -> bool:
    return bool(getattr(_output_layer(model), "_mpo_fp32_head", False))
