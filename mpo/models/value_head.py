"""The critic: the policy architecture with its LM head replaced by a scalar fp32 value head (PPO / VAPO).

The head sits in megatron's output-layer slot, so the critic runs through the same GPTModel, schedules (1F1B under
PP), DDP and optimizer as the policy. Under sequence parallelism each tensor-parallel rank sees only its sequence
shard: the head maps that shard (its weight is tagged ``sequence_parallel`` so finalize_model_grads sums its partial
gradients over TP, as for the norms), then the small ``[s, b, 1]`` values are all-gathered with a split backward, so
every rank scores the full sequence and gradients reach only its own shard.
"""

from __future__ import annotations

from typing import Any

import torch


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` in fp32, replicated over tensor-parallel ranks; returns ``(values [s, b, 1], None)`` like
    megatron's output layer."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # zero init: the critic starts at V = 0 everywhere, so its first targets are the returns themselves
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=torch.float32, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device))
        self.sequence_parallel = sequence_parallel
        for param in (self.weight, self.bias):
            param.sequence_parallel = sequence_parallel  # TP-replicated, gradient from the local shard: summed

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None,
                **_: Any) -> tuple[torch.Tensor, None]:
        values = torch.nn.functional.linear(hidden_states.float(), self.weight, self.bias)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def attach_value_head(model: torch.nn.Module) -> bool:
    """Replace the LM head of this rank's stage with a :class:`ValueHead` (before DDP wrapping). Returns whether the
    stage has a head (only the last pipeline stage does; under VPP, its last chunk)."""
    from mpo.models.chunks import as_chunks

    found = False
    for chunk in as_chunks(model):
        gpt = chunk
        while not hasattr(gpt, "output_layer") and hasattr(gpt, "module"):
            gpt = gpt.module
        # A value head shares nothing with the input embedding: untie on every stage, so no stage joins megatron's
        # embedding-gradient all-reduce between the first and the last pipeline stage.
        gpt.share_embeddings_and_output_weights = False
        if not getattr(gpt, "post_process", False):
            continue
        gpt.output_layer = ValueHead(gpt.config.hidden_size, sequence_parallel=bool(gpt.config.sequence_parallel),
                                     device=next(gpt.parameters()).device)
        found = True
    return found


def scored_values(output: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` values aligned like log-probs (position t: the value of the state before token t, read at input
    position t - 1; 0 at t = 0) from the model's ``[b, s, 1]`` output."""
    values = output[..., 0].float()
    return torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)
