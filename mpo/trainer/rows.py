"""Rollout samples as training rows, split over data-parallel ranks and packed into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mpo.models.forward import MicroBatch


class Elsewhere:
    """The token ids of a sample another data-parallel rank trains on (mpo.trainer.distribute): only its length
    travels, which is all the split of a pass needs; reading the ids themselves is an error."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return self[0]

    def __getitem__(self, index):
        raise RuntimeError("this sample's tokens are on another data-parallel rank: the rank that reads them disagrees "
                           "with mpo.trainer.distribute.dp_owners on which rank trains on it")

    def __getstate__(self):
        return self.length

    def __setstate__(self, state) -> None:
        self.length = state


@dataclass
class Sample:
    """One generated response with everything training needs (built on rank 0; each rank receives its own
    data-parallel share, mpo.trainer.distribute).

    Attributes:
        ids: prompt + completion token ids.
        prompt_len: number of prompt tokens; the loss covers positions prompt_len .. len(ids)-1.
        group: global prompt-group id within the step (0..prompts-1).
        reward: scalar reward.
        advantage: the advantage of each completion token, or one scalar broadcast to all of them.
        rollout_logprobs: the engine's log-probs of the completion tokens.
        routes: the engine's routed experts [len(ids)-1, layers, top_k] (R3), or None.
        versions: the policy version (weights after that many RL steps) each completion token was sampled under.
        loss_mask: per completion token, 1 where it carries loss (None: every one); multi-turn episodes (mpo.envs)
            have 0 at the environment's observation tokens.
        route_layers: the layer numbers of `routes`' layer axis once cut to a pipeline stage's layers
            (mpo.trainer.distribute); None: every layer the engine returned.

    Token fields are lists on rank 0 and compact numpy arrays on the ranks that receive them (mpo.trainer.distribute).
    """

    ids: list[int] | np.ndarray | Elsewhere
    prompt_len: int
    group: int
    reward: float
    advantage: float | list[float] | np.ndarray = 0.0
    rollout_logprobs: list[float] | np.ndarray | None = None
    routes: np.ndarray | None = None
    versions: list[int] | np.ndarray | None = None
    loss_mask: list[float] | np.ndarray | None = None
    route_layers: tuple[int, ...] | None = None


def _pad_sample(length: int) -> Sample:
    """A row with no loss tokens, so every data-parallel rank runs the same number of micro-batches (expert
    parallelism exchanges tokens inside every forward: all ranks of an EP group must run the same forwards)."""
    return Sample(ids=[0] * length, prompt_len=length, group=0, reward=0.0)


def uniform_length(samples: list[Sample], multiple: int = 1) -> int:
    """One padded length for every micro-batch of a step: the longest row, rounded up to `multiple`.

    megatron's pipeline schedule sizes its stage-to-stage buffers from one (seq_length, micro_batch_size) for the
    whole pass, and sequence parallelism splits the sequence over tensor-parallel ranks, so with PP > 1 or TP > 1
    every micro-batch of a forward/backward pass must have the same [b, s] with s divisible by TP.
    """
    longest = max((len(s.ids) for s in samples), default=2)
    return -(-longest // multiple) * multiple


def _microbatch_multiple() -> int:
    """Micro-batches per pass must be a multiple of PP under virtual pipeline stages (megatron's interleaved schedule
    runs them in groups of PP); loss-free padding rows fill the last group, as they fill uneven DP shares."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or \
            parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def sample_extras(rows: list[Sample], n_real: int, width: int) -> dict:
    """The loss tensors of `rows` (one sample per row, right-padded to `width`): see :func:`rank_microbatches`."""
    b = len(rows)
    mask = torch.zeros(b, width)
    adv = torch.zeros(b, width)
    rollout_lp = torch.zeros(b, width)
    for i, s in enumerate(rows):
        n = len(s.ids)
        # multi-turn rows (mpo.envs): loss only on the model's own tokens, not the environment's
        mask[i, s.prompt_len : n] = 1.0 if s.loss_mask is None else torch.as_tensor(s.loss_mask, dtype=mask.dtype)
        adv[i, s.prompt_len : n] = torch.as_tensor(s.advantage, dtype=adv.dtype)
        if s.rollout_logprobs is not None:
            rollout_lp[i, s.prompt_len : n] = torch.as_tensor(s.rollout_logprobs, dtype=torch.float32)
    return {"mask": mask, "advantages": adv, "rollout_logprobs": rollout_lp, "n_real": n_real,
            "group_ids": torch.tensor([s.group for s in rows]), "rewards": torch.tensor([s.reward for s in rows]),
            "samples": rows}


def rank_microbatches(samples: list[Sample], *, dp_rank: int, dp_size: int, micro_batch_size: int,
                      seq_len: int | None = None, device: torch.device | str = "cpu") -> list[MicroBatch]:
    """This DP rank's share of `samples` (round-robin), as micro-batches with loss tensors in `extras`.

    With `seq_len` (see :func:`uniform_length`) every micro-batch is padded to exactly [micro_batch_size, seq_len];
    without it each is as long as its own longest row (enough without PP and TP).

    extras: mask [b,s] (1 at completion tokens), advantages [b,s], group_ids [b], rewards [b], rollout_logprobs
    [b,s] (0 where unknown), n_real (rows that are not padding). Built on the host, then moved to `device` (the
    rank's compute device) here, so everything the loss and its collectives touch is where NCCL needs it.
    """
    per_rank = -(-len(samples) // dp_size)
    count = -(-per_rank // micro_batch_size)
    multiple = _microbatch_multiple()
    count = -(-count // multiple) * multiple
    mine = samples[dp_rank::dp_size]
    out = []
    for m in range(count):
        real = mine[m * micro_batch_size : (m + 1) * micro_batch_size]
        rows = real or [_pad_sample(2)]
        if seq_len is not None:
            rows = rows + [_pad_sample(2)] * (micro_batch_size - len(rows))
        seq = seq_len if seq_len is not None else max(len(s.ids) for s in rows)
        ids = torch.zeros(len(rows), seq, dtype=torch.long)
        for i, s in enumerate(rows):
            ids[i, : len(s.ids)] = torch.as_tensor(s.ids)
        out.append(MicroBatch(ids, extras=sample_extras(rows, len(real), seq)).to(device))
    return out
