"""Virtual pipeline parallelism (VPP): the model chunks one rank holds, as one module.

With `parallel.virtual_pipeline_parallel = v` megatron's interleaved schedule runs v GPTModel chunks per rank (chunk
k of stage p holds the layers after chunk k of stages < p). The trainer, checkpoints and weight sync treat the model
as one module; `ModelChunks` keeps that true: its state_dict and sharded_state_dict are the chunks' under
`chunks.<k>.` (the torch_dist keys inside stay megatron's global, layout-free ones), and the schedule, DDP and the
optimizer get the list back with `as_chunks`. Without VPP nothing is wrapped: a plain GPTModel is its own one chunk.
"""

from __future__ import annotations

from typing import Any

import torch


class ModelChunks(torch.nn.Module):
    """This rank's virtual-pipeline chunks, in vp_stage order."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    @property
    def config(self) -> Any:
        return self.chunks[0].config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ModelChunks is run by megatron's interleaved schedule (mpo.models.forward), not called")

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> dict:
        # Each chunk's ShardedTensors keep megatron's global keys (the prefix would leak into them); only the
        # dict keys get `chunks.<k>.`, so load_state_dict of the loaded dict finds every chunk's parameters.
        merged: dict = {}
        for k, chunk in enumerate(self.chunks):
            merged.update({f"{prefix}chunks.{k}.{key}": value
                           for key, value in chunk.sharded_state_dict(*args, **kwargs).items()})
        return merged

    def zero_grad_buffer(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()


def as_chunks(model: torch.nn.Module | list) -> list[torch.nn.Module]:
    """The list of model chunks megatron's schedules and optimizer take."""
    if isinstance(model, (list, tuple)):
        return list(model)
    return list(model.chunks) if isinstance(model, ModelChunks) else [model]
