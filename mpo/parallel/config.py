"""Parallel layout: tensor, pipeline, expert, expert-tensor and context parallel sizes, validated up front."""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot work with the world size or the model."""


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron-core parallel sizes. Data parallel size is whatever is left of the world size.

    Attributes:
        tensor_parallel: TP size; splits attention heads, MLP columns and the vocabulary.
        pipeline_parallel: PP size; splits the layers into stages.
        expert_parallel: EP size; splits the experts of each MoE layer.
        expert_tensor_parallel: TP size inside each expert; None means megatron's default (equal to TP).
        context_parallel: CP size; splits the sequence (megatron-core ring attention; needs TE on GPU).
        sequence_parallel: megatron sequence parallelism; None means on whenever TP > 1 (MoE training requires it).
        distributed_optimizer: megatron's DistributedOptimizer (Adam state, fp32 main params and the grad reduce
            sharded over the data-parallel ranks: ZeRO-1/2); None means on with CUDA, off on CPU. At the 30B recipe's
            EP8 x 16 ranks the plain optimizer holds ~5.2B parameters' Adam state per GPU, more than an H100 has.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    context_parallel: int = 1
    sequence_parallel: bool | None = None
    distributed_optimizer: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name}={value!r} must be a positive integer")
        if self.expert_tensor_parallel is not None and self.expert_tensor_parallel < 1:
            raise LayoutError(f"parallel.expert_tensor_parallel={self.expert_tensor_parallel!r} must be >= 1 or None")

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel or self.tensor_parallel

    @property
    def use_sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel

    def use_distributed_optimizer(self, is_gpu: bool) -> bool:
        return is_gpu if self.distributed_optimizer is None else self.distributed_optimizer

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def data_parallel(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    def validate(self, world_size: int, *, num_layers: int | None = None, num_attention_heads: int | None = None,
                 num_query_groups: int | None = None, num_experts: int | None = None) -> None:
        """Raise LayoutError naming the field if this layout cannot run on `world_size` ranks with this model."""

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise LayoutError(message)

        # Model divisibility first: it names the field a user most likely got wrong.
        if num_layers is not None:
            need(num_layers % self.pipeline_parallel == 0,
                 f"pipeline_parallel={self.pipeline_parallel} does not divide num_layers={num_layers}")
        if num_attention_heads is not None:
            need(num_attention_heads % self.tensor_parallel == 0,
                 f"tensor_parallel={self.tensor_parallel} does not divide num_attention_heads={num_attention_heads}")
        if num_query_groups is not None:
            need(num_query_groups % self.tensor_parallel == 0 or self.tensor_parallel % num_query_groups == 0,
                 f"tensor_parallel={self.tensor_parallel} and num_query_groups={num_query_groups}: one must divide "
                 "the other")
        if num_experts is not None:
            need(num_experts % self.expert_parallel == 0,
                 f"expert_parallel={self.expert_parallel} does not divide num_experts={num_experts}")
        elif self.expert_parallel > 1:
            raise LayoutError(f"expert_parallel={self.expert_parallel} needs a model with experts")
        mp = self.model_parallel_size
        need(world_size % mp == 0, f"world size {world_size} is not divisible by tensor_parallel*pipeline_parallel*"
             f"context_parallel = {self.tensor_parallel}*{self.pipeline_parallel}*{self.context_parallel} = {mp}")
        # megatron builds the expert grid over the same ranks: ETP x EP x expert-DP x PP.
        expert_mp = self.etp * self.expert_parallel * self.pipeline_parallel
        need(world_size % expert_mp == 0, f"world size {world_size} is not divisible by expert_tensor_parallel*"
             f"expert_parallel*pipeline_parallel = {self.etp}*{self.expert_parallel}*{self.pipeline_parallel}")
