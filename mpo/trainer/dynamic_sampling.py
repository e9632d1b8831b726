"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2): over-sample prompt groups until the step
has `data.prompts_per_step` of them whose rewards are not all equal, and train on exactly those.

A group whose G responses all got the same reward has zero advantage under every group baseline: it only shrinks
the batch (kept_samples_frac < 1) and the gradient's effective size. Dynamic sampling replaces it with fresh groups.

Rounds are driven by `sample_varied(draw, wanted, max_rounds)`; `draw(round, count)` generates and scores `count`
new groups. The trainer draws every round's prompts and sampling seeds as a pure function of (seed, step, round)
(toy tasks) or from the data stream's next rows (text tasks, whose position is checkpointed), so a resumed run draws
the same groups as an uninterrupted one. Which groups are kept depends only on the rewards, in draw order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mpo.algorithms.advantages import group_stats


@dataclass
class Drawn:
    """Prompt groups generated and scored: `group_size` consecutive responses per prompt, in prompt order.

    Attributes:
        prompts: one per group.
        results: the engines' responses (GenerateResult), group after group.
        rewards: each response's reward, shaping (overlong penalties) included.
        penalties: each response's overlong penalty (0 when off).
        texts: decoded responses (text tasks) or None.
        errors: responses the verifier failed on.
        rollout_s: generation wall time.
        restarts: engine restarts while generating.
        env: multi-turn episodes' counters (mpo.envs.rollout.EnvStats), None for single turns.
    """

    group_size: int
    prompts: list = field(default_factory=list)
    results: list = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    penalties: list[float] = field(default_factory=list)
    texts: list[str] | None = None
    errors: int = 0
    rollout_s: float = 0.0
    restarts: int = 0
    env: Any = None

    def __len__(self) -> int:
        return len(self.prompts)

    def extend(self, other: Drawn) -> None:
        """Append another round's groups (and add up its counters)."""
        self.texts = self.texts + other.texts if self.texts is not None and other.texts is not None else None
        self.prompts += other.prompts
        self.results += other.results
        self.rewards += other.rewards
        self.penalties += other.penalties
        self.errors += other.errors
        self.rollout_s += other.rollout_s
        if other.env is not None:
            if self.env is None:
                from mpo.envs.rollout import EnvStats

                self.env = EnvStats()
            self.env.add(other.env)
        self.restarts += other.restarts

    def groups(self, indices: Sequence[int]) -> Drawn:
        """The groups at `indices` (in that order), as a batch of their own; counters stay with the whole draw."""
        G = self.group_size
        rows = [g * G + j for g in indices for j in range(G)]
        return Drawn(G, [self.prompts[g] for g in indices], [self.results[i] for i in rows],
                     [self.rewards[i] for i in rows], [self.penalties[i] for i in rows],
                     None if self.texts is None else [self.texts[i] for i in rows])


def varied_groups(rewards: Sequence[float], group_size: int) -> list[int]:
    """Indices of the groups (consecutive `group_size` rewards) whose rewards are not all equal, by the same test the
    advantage estimators' zero_variance uses (so none of them is filtered afterwards)."""
    if not rewards:
        return []
    ids = torch.arange(len(rewards)) // group_size
    zero = (group_stats(torch.tensor(rewards, dtype=torch.float64), ids).std == 0)[::group_size]
    return [g for g, z in enumerate(zero.tolist()) if not z]


def round_size(missing: int, kept: int, drawn: int, per_step: int) -> int:
    """Groups to draw next: the missing ones scaled by the keep rate seen so far, at most `per_step` (one round is no
    bigger than a normal step's batch) and at least `missing`."""
    if kept == 0:
        return per_step
    return max(missing, min(per_step, math.ceil(missing * drawn / kept)))


@dataclass
class Sampled:
    """A step's outcome: `batch` to train on (at most `wanted` varied groups), every group `drawn`, the number of
    `rounds` taken, and whether the rounds ran out first (`exhausted`)."""

    batch: Drawn
    drawn: Drawn
    rounds: int
    exhausted: bool


def sample_varied(draw: Callable[[int, int], Drawn], wanted: int, max_rounds: int) -> Sampled:
    """Draw rounds (`draw(round, count)`) until `wanted` groups have non-zero reward variance or `max_rounds` rounds
    were drawn; keep the first `wanted` varied groups in draw order."""
    if wanted < 1 or max_rounds < 1:
        raise ValueError(f"wanted={wanted} and max_rounds={max_rounds} must be >= 1")
    drawn = draw(0, wanted)
    varied = varied_groups(drawn.rewards, drawn.group_size)
    rounds = 1
    while rounds < max_rounds and len(varied) < wanted:
        new = draw(rounds, round_size(wanted - len(varied), len(varied), len(drawn), wanted))
        varied += [len(drawn) + g for g in varied_groups(new.rewards, new.group_size)]
        drawn.extend(new)
        rounds += 1
    return Sampled(drawn.groups(varied[:wanted]), drawn, rounds, len(varied) < wanted)
