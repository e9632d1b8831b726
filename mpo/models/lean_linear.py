"""megatron-core's linear layers on the local spec at tensor-parallel size 1, without their parallel plumbing.

Every Column/RowParallelLinear of megatron's local spec (the CPU path, and a GPU without Transformer Engine) runs its
matmul inside a custom autograd Function with a Python backward (`LinearWithGradAccumulationAndAsyncCommunication`),
between two more custom Functions for the tensor-parallel copy and reduce, all of which are identities when the
layer's tensor-parallel group has one rank. On a small model that plumbing, not the matmuls, is the cost: the CPU
demo's model runs 73 linears per forward, and one forward of its 64 x 9 micro-batch took 10.7 -> 8.9 ms with the
plain `F.linear` below, a forward and backward 23.0 -> 20.2 ms (1 thread, median of 20; `tests/test_lean_linear.py`
shows logits and every gradient bit-identical to megatron's classes).

`LeanColumnParallelLinear` / `LeanRowParallelLinear` are megatron's classes (the same parameters, state dict and
sharded state dict, the same construction) whose forward is `F.linear` (bias added after it, as megatron adds it)
when nothing but the matmul would happen: one rank in the layer's tensor-parallel group, no gradient-accumulation
fusion (it writes into `main_grad` itself), no deferred embedding wgrad, no weight re-gathering, no CPU offloading.
Anything else runs megatron's own forward. `use_lean_linears` puts them into a local layer or block spec.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size


def _matmul_only(layer: ColumnParallelLinear | RowParallelLinear) -> bool:
    """True when megatron's forward of `layer` would be just its matmul (and bias): see the module docstring."""
    config = layer.config
    return (get_pg_size(layer.tp_group) == 1 and not layer.gradient_accumulation_fusion
            and not config.defer_embedding_wgrad_compute and getattr(layer, "gtp_remat_size", 1) == 1
            and not config.cpu_offloading)


def _linear(layer: ColumnParallelLinear | RowParallelLinear, input_: torch.Tensor,
            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    output = F.linear(input_, weight)
    if layer.skip_bias_add:
        return output, layer.bias
    return (output + layer.bias if layer.bias is not None else output), None


class LeanColumnParallelLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear; a plain matmul when that is all its forward would do."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.matmul_only = _matmul_only(self)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if (not self.matmul_only or self.config._cpu_offloading_context is not None
                or (weight is None and self.weight is None)):
            return super().forward(input_, weight, runtime_gather_output)
        if weight is not None and weight.shape != (self.output_size_per_partition, self.input_size):
            return super().forward(input_, weight, runtime_gather_output)  # megatron's own shape error
        return _linear(self, input_, self.weight if weight is None else weight)


class LeanRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear; a plain matmul when that is all its forward would do."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.matmul_only = _matmul_only(self)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.matmul_only or self.config._cpu_offloading_context is not None:
            return super().forward(input_)
        return _linear(self, input_, self.weight)


_LEAN = {ColumnParallelLinear: LeanColumnParallelLinear, RowParallelLinear: LeanRowParallelLinear}
# megatron-core 0.19's MLA accepts its down projections only as its own classes (`in [Linear, ColumnParallelLinear,
# ...]`, ValueError otherwise): they stay megatron's.
_KEPT = frozenset({"linear_q_down_proj", "linear_kv_down_proj", "linear_qkv_down_proj"})


def use_lean_linears(spec: Any) -> Any:
    """A copy of a layer spec or block spec with every ColumnParallelLinear / RowParallelLinear replaced by its lean
    subclass (megatron's spec objects are left as they are)."""
    spec = copy.deepcopy(spec)
    _swap(spec)
    return spec


def _swap(node: Any) -> None:
    if isinstance(node, ModuleSpec):
        _swap(node.submodules)
    elif isinstance(node, functools.partial):  # megatron 0.19's MoE specs: partial(MoELayer, submodules=...)
        for value in (*node.args, *node.keywords.values()):
            _swap(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _swap(value)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if isinstance(value, type) and value in _LEAN and field.name not in _KEPT:
                setattr(node, field.name, _LEAN[value])
            else:
                _swap(value)
