"""megatron-core's local-spec linears and experts without their per-call plumbing, where it has nothing to do.

megatron's local spec (the CPU path, and a GPU without Transformer Engine) runs every Column/RowParallelLinear's
matmul inside a custom autograd Function with a Python backward (`LinearWithGradAccumulationAndAsyncCommunication`),
between two more custom Functions for the tensor-parallel copy and reduce, all of which are identities when the
layer's tensor-parallel group has one rank; and its SequentialMLP runs each expert as its own MLP module, two such
linears each. On a small model the plumbing, not the arithmetic, is the cost: the CPU demo's model runs 73 linears
per forward, 64 of them expert linears on ~150 tokens each (timings: docs/measurements.md).

* `LeanColumnParallelLinear` / `LeanRowParallelLinear` are megatron's classes (the same parameters, state dict,
  sharded state dict and construction) whose forward is `F.linear` (bias added after it, as megatron adds it) when
  nothing but the matmul would happen: one rank in the layer's tensor-parallel group, no gradient-accumulation fusion
  (it writes into `main_grad` itself), no deferred embedding wgrad, no weight re-gathering, no CPU offloading.
* `GroupedSequentialMLP` is megatron's SequentialMLP (the same per-expert parameters and checkpoint layout) whose
  forward runs all experts in two `torch._grouped_mm` calls over the expert weights stacked per call, where torch's
  grouped GEMM takes the device and dtype (mpo.parallel.device.grouped_mm_dtypes: the CPU in fp32/bf16, CUDA in bf16
  on compute capability >= 8.0), when its experts are plain: lean linears without bias, a (gated) activation megatron
  applies unfused, no quantisation, rows whose byte strides torch's grouped matmul accepts (multiples of 16). On the
  CPU torch's grouped matmul computes each group with the same matmul as the per-expert loop (outputs and gradients
  bit-identical); on CUDA it is one CUTLASS/cuBLAS grouped kernel instead of a matmul launch per expert, equal to the
  loop within bf16 rounding (the offline GPU tier measures it). The stacked weights are a per-call copy of this
  rank's experts (under expert parallelism its share, not the model's).

Anything else runs megatron's own forward. `tests/test_lean_local.py` builds the same model from megatron's unmodified
spec and checks logits and every gradient bit for bit. `use_lean_modules` puts the classes into a local layer or
block spec.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size

from mpo.parallel.device import grouped_mm_dtypes


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


class GroupedSequentialMLP(SequentialMLP):
    """megatron's SequentialMLP; plain experts run as two grouped matmuls where torch has them for the device and
    dtype (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        linears = [layer for expert in self.local_experts for layer in (expert.linear_fc1, expert.linear_fc2)]
        widths = (config.hidden_size, config.moe_ffn_hidden_size, 2 * config.moe_ffn_hidden_size)
        self.grouped = (
            self.num_local_experts > 1 and not (config.fp8 or config.fp4) and not config.moe_apply_probs_on_input
            and config.moe_latent_size is None and not config.use_te_activation_func
            and not config.bias_activation_fusion and config.activation_func_clamp_value is None
            and all(isinstance(layer, (LeanColumnParallelLinear, LeanRowParallelLinear)) and layer.matmul_only
                    and layer.bias is None for layer in linears)
            and all(width * config.params_dtype.itemsize % 16 == 0 for width in widths))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        hidden = permuted_local_hidden_states
        if (not self.grouped or hidden.dtype != self.config.params_dtype
                or hidden.dtype not in grouped_mm_dtypes(hidden.device)):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        # what each expert's MLP.forward computes (megatron's unfused branch), for all experts at once
        ends = torch.cumsum(torch.as_tensor(tokens_per_expert), 0).to(device=hidden.device, dtype=torch.int32)
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts]).transpose(1, 2)
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts]).transpose(1, 2)
        intermediate = torch._grouped_mm(hidden, fc1, offs=ends)
        if self.config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
            intermediate = self.config.activation_func(x_glu) * (x_linear + self.config.glu_linear_offset)
        else:
            intermediate = self.config.activation_func(intermediate)
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)
        return torch._grouped_mm(intermediate, fc2, offs=ends), None


_LEAN: dict[type, type] = {ColumnParallelLinear: LeanColumnParallelLinear, RowParallelLinear: LeanRowParallelLinear,
                           SequentialMLP: GroupedSequentialMLP}
# megatron-core 0.19's MLA accepts its down projections only as its own classes (`in [Linear, ColumnParallelLinear,
# ...]`, ValueError otherwise): they stay megatron's.
_KEPT = frozenset({"linear_q_down_proj", "linear_kv_down_proj", "linear_qkv_down_proj"})


def use_lean_modules(spec: Any) -> Any:
    """A copy of a layer spec or block spec with megatron's ColumnParallelLinear, RowParallelLinear and SequentialMLP
    replaced by their lean subclasses (megatron's spec objects are left as they are)."""
    spec = copy.deepcopy(spec)
    _swap(spec)
    return spec


def _lean(value: Any) -> Any:
    """`value` with its class swapped (a class, or megatron 0.19's partial(SequentialMLP, submodules=...)), else None."""
    if isinstance(value, type) and value in _LEAN:
        return _LEAN[value]
    if isinstance(value, functools.partial) and value.func in _LEAN:
        return functools.partial(_LEAN[value.func], *value.args, **value.keywords)
    return None


def _swap(node: Any) -> None:
    if isinstance(node, ModuleSpec):
        if isinstance(node.module, type) and node.module in _LEAN:
            node.module = _LEAN[node.module]
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
            swapped = None if field.name in _KEPT else _lean(value)
            if swapped is not None:
                setattr(node, field.name, swapped)
            _swap(swapped if swapped is not None else value)
