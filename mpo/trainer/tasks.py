"""The run's task, as the trainer sees it: prompts to draw, when generation stops, how responses are scored, and the
data position to checkpoint. Two kinds behind one interface:

  * ToyRun: the digit tasks in token space (prompts a pure function of (seed, step); token-level partial credit);
  * TextRun: rows from files or reasoning-gym, encoded by the checkpoint's tokenizer (chat template), generation
    stopped at the tokenizer's EOS ids, responses decoded and scored by a reward function in a process pool (a
    verifier that raises or hangs scores 0 and counts in reward_errors).

Only rank 0 draws and scores (other ranks get the rows by broadcast); the data position (the stream's epoch and
offset) is trainer state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from mpo.config import TrainConfig
from mpo.data.retirement import prompt_key
from mpo.data.task_spec import parse_task

log = logging.getLogger(__name__)


@dataclass
class Scored:
    """One step's scores: rewards per response, responses the verifier failed on, and decoded texts (text tasks)."""

    rewards: list[float]
    errors: int = 0
    texts: list[str] | None = None


@dataclass(frozen=True)
class _RoundStream:
    """A toy task's prompts of one dynamic-sampling round (a PromptSource for prompt retirement)."""

    task: Any
    round_: int

    def prompts(self, seed: int, step: int, count: int) -> list:
        return self.task.prompts(seed, step, count, round_=self.round_)


class _NoPosition:
    """A task with no data position to checkpoint (the toy tasks' prompts are a pure function of (seed, step): the
    step is the position) and nothing to close."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


class ToyRun(_NoPosition):
    """The built-in digit tasks (mpo.data.toy)."""

    kind = "toy"

    def __init__(self, config: TrainConfig) -> None:
        from mpo.data.toy import EOS, task_from_name

        self.config = config
        self.task = task_from_name(config.data.task, config.data.digits)
        self.stop_token_ids: tuple[int, ...] = (EOS,)
        self.max_answer_tokens: int | None = self.task.max_answer_tokens

    def draw(self, step: int, count: int, retirement=None, *, round_: int = 0) -> list:
        """`count` prompts of step `step`: a pure function of (seed, step, round_); round_ > 0 (dynamic sampling's
        further draws) reads another stream of the step, so its prompts are new ones."""
        seed = self.config.seed
        source = self.task if round_ == 0 else _RoundStream(self.task, round_)
        if retirement is not None:
            return retirement.sample(source, seed, step, count)
        return source.prompts(seed, step, count)

    def prompts(self, seed: int, step: int, count: int) -> list:
        """The toy task's prompts of (seed, step): a pure function (mpo.data.retirement.PromptSource)."""
        return self.task.prompts(seed, step, count)

    def warm_start_prompts(self, step: int, count: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(prompt ids, answer ids ending in EOS) pairs for the supervised warm start."""
        return [(p.ids, p.answer) for p in self.task.prompts(self.config.seed + 7919, step, count)]

    def score(self, prompts: Sequence, outputs: Sequence[list[int]]) -> Scored:
        from mpo.data.toy import toy_reward

        return Scored([toy_reward(out, p.answer) for p, out in zip(prompts, outputs, strict=True)])

    def describe(self, prompt) -> str:
        return " ".join(map(str, prompt.ids))


def prompt_token_limit(config: TrainConfig) -> int:
    """The longest prompt the run sends: data.max_prompt_tokens, never above what an engine accepts (the model's
    context length minus rollout.max_new_tokens: a longer prompt is a 400 that would end the run)."""
    from mpo.config_checks import model_config
    from mpo.data.sources import DataError

    context = model_config(config).max_position_embeddings
    room = context - config.rollout.max_new_tokens
    if room < 1:
        raise DataError(f"the model's context length {context} leaves no room for a prompt with "
                        f"rollout.max_new_tokens={config.rollout.max_new_tokens}; lower rollout.max_new_tokens")
    wanted = config.data.max_prompt_tokens
    if wanted is not None and wanted > room:
        log.warning("data.max_prompt_tokens=%d is over the room the context leaves (%d = %d - rollout.max_new_tokens):"
                    " prompts over %d tokens are dropped", wanted, room, context, room)
    return room if wanted is None else min(wanted, room)


def default_reward(kind: str) -> str:
    """The reward a text task gets when reward.fn is unset: reasoning-gym's own scorer, else math equivalence."""
    return "reasoning_gym" if kind == "reasoning_gym" else "math"


class TextRun:
    """Text rows (files or reasoning-gym) through the tokenizer of model.tokenizer_dir / model.hf_dir."""

    kind = "text"

    def __init__(self, config: TrainConfig) -> None:
        from mpo.data.chat import PromptEncoder, eos_token_ids, load_tokenizer
        from mpo.data.sources import open_source, skipped_rows
        from mpo.data.stream import RowStream
        from mpo.data.text_task import TextTask

        d = config.data
        self.config = config
        self.spec = parse_task(d.task)
        tokenizer_dir = config.model.tokenizer_dir or config.model.hf_dir
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.encoder = PromptEncoder(self.tokenizer, chat_template=d.chat_template, system_prompt=d.system_prompt)
        self.stop_token_ids = tuple(eos_token_ids(tokenizer_dir, self.tokenizer))
        self.max_answer_tokens: int | None = None
        source = open_source(d.task, prompt_key=d.prompt_key, answer_key=d.answer_key, max_row_bytes=d.max_row_bytes)
        skipped, first = skipped_rows(source)
        if skipped:
            log.warning("data: %d jsonl lines over data.max_row_bytes=%d skipped (first: %s)", skipped,
                        d.max_row_bytes, first)
        limit = prompt_token_limit(config)
        self.data = TextTask(RowStream(source, config.seed), self.encoder, max_prompt_tokens=limit)
        # The warm start reads its own order of the same rows, so it never moves the RL stream's position.
        self.warm_data = TextTask(RowStream(source, config.seed + 7919), self.encoder, max_prompt_tokens=limit)
        self.env = None  # rollout.env: (EnvPool, TurnRenderer); the environments score, no reward pool
        if config.rollout.env is not None:
            from mpo.envs.pool import EnvPool
            from mpo.envs.render import TurnRenderer

            self.pool = EnvPool(config.rollout.env, timeout_s=config.reward.timeout_s, workers=config.reward.workers,
                                max_memory_mb=config.reward.max_memory_mb,
                                max_state_bytes=config.rollout.max_env_state_bytes)
            self.env = (self.pool, TurnRenderer(self.encoder, self.stop_token_ids))
            return
        from mpo.rewards import RewardPool

        self.pool = RewardPool(config.reward.fn or default_reward(self.spec.kind), timeout_s=config.reward.timeout_s,
                               workers=config.reward.workers, max_memory_mb=config.reward.max_memory_mb)

    def draw(self, step: int, count: int, retirement=None, *, round_: int = 0) -> list:
        """The stream's next `count` prompts (not retired ones): every draw, dynamic sampling's further rounds
        (`round_` > 0) included, moves the checkpointed position on."""
        if retirement is None:
            return self.data.next_prompts(count)
        chosen: list = []
        for _ in range(retirement.max_draw_factor):
            chosen += [p for p in self.data.next_prompts(count - len(chosen)) if prompt_key(p) not in retirement.retired]
            if len(chosen) == count:
                return chosen
        raise RuntimeError(f"data: fewer than {count} unretired prompts in {retirement.max_draw_factor} draws "
                           f"(data.retire_pass_rate={retirement.threshold})")

    def warm_start_prompts(self, step: int, count: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [(p.ids, p.answer_ids) for p in self.warm_data.next_prompts(count)]

    def score(self, prompts: Sequence, outputs: Sequence[list[int]]) -> Scored:
        texts = [self.encoder.decode(out) for out in outputs]
        rewards, errors = self.pool.score(texts, [p.answer for p in prompts], [p.metadata for p in prompts])
        return Scored(list(rewards), errors, texts)

    def describe(self, prompt) -> str:
        return self.encoder.decode(list(prompt.ids))

    @property
    def dropped_long(self) -> int:
        return self.data.dropped_long

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict(), "warm": self.warm_data.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("data"):
            self.data.load_state_dict(state["data"])
        if state.get("warm"):
            self.warm_data.load_state_dict(state["warm"])

    def close(self) -> None:
        self.pool.close()


class OnRankZero(_NoPosition):
    """What ranks other than 0 hold for a text task: rank 0 reads the data (a 10 GB jsonl is indexed once, not on
    every rank), draws, scores and checkpoints the position; the others receive prompts by broadcast."""

    kind = "text"


def make_task(config: TrainConfig, *, rank: int = 0):
    """The run's task: the toy tasks on every rank (a pure function of the seed); a text task on rank 0 only."""
    if parse_task(config.data.task).kind == "toy":
        return ToyRun(config)
    return TextRun(config) if rank == 0 else OnRankZero()
