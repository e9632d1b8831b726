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
        num_layers_in_first_stage: layers of the first pipeline stage (megatron num_layers_in_first_pipeline_stage);
            None: an equal share. With it (or num_layers_in_last_stage) the stages may hold different layer counts
            (DeepSeek-V3's 61 layers, Qwen3-235B's 94); the stages in between split the rest equally.
        num_layers_in_last_stage: layers of the last pipeline stage (megatron num_layers_in_last_pipeline_stage).
        virtual_pipeline_parallel: model chunks per pipeline stage (megatron's interleaved 1F1B schedule, VPP);
            None: one chunk. Chunk v of stage p holds the layers after those of chunk v of stages < p.
        distributed_optimizer: shard the optimizer state (fp32 master weights, Adam moments) and the gradient
            reduce-scatter over the data-parallel ranks (megatron use_distributed_optimizer); None: on with CUDA.
        distributed_timeout_s: how long a collective may wait before the job fails (NCCL and gloo groups). Every rank
            waits while rank 0 generates a step's rollouts (35-50 minutes at 32k tokens): that wait is not one
            collective but a poll of rank 0's heartbeat, which fails once rank 0 has been silent this long
            (mpo.trainer.distribute.RolloutWait).
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    context_parallel: int = 1
    sequence_parallel: bool | None = None
    num_layers_in_first_stage: int | None = None
    num_layers_in_last_stage: int | None = None
    virtual_pipeline_parallel: int | None = None
    distributed_optimizer: bool | None = None
    distributed_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name}={value!r} must be a positive integer")
        if not self.distributed_timeout_s > 0:
            raise LayoutError(f"parallel.distributed_timeout_s={self.distributed_timeout_s!r} must be > 0")
        if self.expert_tensor_parallel is not None and self.expert_tensor_parallel < 1:
            raise LayoutError(f"parallel.expert_tensor_parallel={self.expert_tensor_parallel!r} must be >= 1 or None")
        for name, least in (("num_layers_in_first_stage", 1), ("num_layers_in_last_stage", 1),
                            ("virtual_pipeline_parallel", 2)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < least):
                raise LayoutError(f"parallel.{name}={value!r}; valid values: null or an integer >= {least}")
            if value is not None and self.pipeline_parallel < 2:
                raise LayoutError(f"parallel.{name}={value} needs pipeline_parallel >= 2 (it is "
                                  f"{self.pipeline_parallel}), or leave it unset (null)")

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel or self.tensor_parallel

    @property
    def use_sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel

    def use_distributed_optimizer(self, is_gpu: bool) -> bool:
        return is_gpu if self.distributed_optimizer is None else self.distributed_optimizer

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline stage (1 without virtual pipeline parallelism)."""
        return self.virtual_pipeline_parallel or 1

    def stage_layers(self, num_layers: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Global (0-based) layer ids of every model chunk: ``[pp_rank][vp_stage] -> layer ids``.

        Megatron's placement (transformer_block.get_num_layers_to_build, transformer_layer.
        get_transformer_layer_offset), restated here so the plan and the checks need no process group: the first /
        last stage hold num_layers_in_first/last_stage layers, the other stages split the rest equally, and with
        virtual stages every stage's share is cut into vpp equal chunks, chunk v of all stages coming before chunk
        v+1 of any stage. Raises LayoutError (one line, naming the field) when the layers cannot be placed.
        """
        pp, vpp = self.pipeline_parallel, self.vpp
        first, last = self.num_layers_in_first_stage, self.num_layers_in_last_stage
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if first is None and last is None:
            if num_layers % pp:
                raise LayoutError(f"pipeline_parallel={pp} does not divide num_layers={num_layers}; set "
                                  f"parallel.num_layers_in_first_stage / num_layers_in_last_stage for uneven stages "
                                  f"(e.g. {_uneven_hint(num_layers, pp)})")
            per_stage = [num_layers // pp] * pp
        else:
            if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and (
                    middle_layers <= 0 or middle_layers % middle_stages)):
                raise LayoutError(
                    f"parallel.num_layers_in_first_stage={first}, num_layers_in_last_stage={last}: the other "
                    f"{middle_layers} of num_layers={num_layers} layers cannot be split equally over the "
                    f"{middle_stages} middle stage(s) of pipeline_parallel={pp} (e.g. {_uneven_hint(num_layers, pp)})")
            per_stage = [middle_layers // middle_stages if middle_stages else 0] * pp
            if first is not None:
                per_stage[0] = first
            if last is not None:
                per_stage[-1] = last
        for rank, count in enumerate(per_stage):
            if count % vpp:
                raise LayoutError(f"parallel.virtual_pipeline_parallel={vpp} does not divide the {count} layers of "
                                  f"pipeline stage {rank} (num_layers={num_layers}, stages {per_stage})")
        chunk = [count // vpp for count in per_stage]
        out, start = [[() for _ in range(vpp)] for _ in range(pp)], 0
        for v in range(vpp):
            for rank in range(pp):
                out[rank][v] = tuple(range(start, start + chunk[rank]))
                start += chunk[rank]
        return tuple(tuple(stage) for stage in out)

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
            self.stage_layers(num_layers)
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


def _uneven_hint(num_layers: int, pp: int) -> str:
    """A valid uneven split to suggest: the remainder taken off the first stage (or off the first and last)."""
    if pp == 2:
        return f"num_layers_in_first_stage={num_layers // 2}" if num_layers >= 2 else "fewer stages"
    for first in range(1, num_layers):
        if (num_layers - first) % (pp - 1) == 0 and num_layers - first >= pp - 1:
            return f"num_layers_in_first_stage={first}"
    return "fewer stages"
