"""Multi-turn episodes: the engine generates one assistant turn per live episode (all of them in one batched call
per turn), the environments answer in their worker processes, and each episode becomes one training row.

Token accounting of a row (GenerateResult-shaped, so the trainer builds its Sample as for one turn):
  * prompt_ids: the opening (reset()'s messages through the chat template, with the generation prompt);
  * output_ids: turn 1's tokens exactly as generated, the rendered observation (mpo.envs.render), turn 2's tokens,
    ...; the row always ends with generated tokens (an observation is appended only when another turn follows);
  * meta["loss_mask"]: 1 at generated tokens, 0 at observation tokens: the loss, the advantages and the rollout
    corrections see only the model's tokens;
  * output_logprobs: the engine's log-prob of each generated token (0 at observation tokens, masked);
  * meta["output_token_weight_versions"]: each generated token's weight version (an int, -1 unknown; an
    observation token takes the version of the token before it, so it never changes a row's staleness);
  * routed_experts: the last turn's call, whose input is the whole sequence but its last generated turn: the engine
    routes every position of its prompt (prefill included), so the rows cover positions 0 .. len-2 and R3 replays
    observation and earlier turns' positions as the engine routed them in that call.

An episode ends when the environment says done, after rollout.max_turns turns, when the context has no room for another
turn, or when its environment fails (reset, step or an unrenderable observation): reward 0, counted in env_errors.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from mpo.data.sources import DataError
from mpo.rollout.protocol import GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Episode:
    prompt: Any  # the dataset prompt (TextPrompt) the episode was drawn for
    state: bytes | None = None  # the pickled environment between turns
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # response side: generated and observation tokens
    loss_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    error: bool = False
    routes: Any = None
    finish_reason: dict = field(default_factory=dict)

    def fail(self) -> None:
        self.error, self.done, self.reward = True, True, 0.0

    def result(self) -> GenerateResult:
        return GenerateResult(prompt_ids=list(self.prompt_ids or self.prompt.ids), output_ids=list(self.ids),
                              output_logprobs=list(self.logprobs), finish_reason=dict(self.finish_reason),
                              routed_experts=self.routes,
                              meta={"loss_mask": list(self.loss_mask), "env_turns": self.turns,
                                    "env_error": self.error, "output_token_weight_versions": list(self.versions)})


@dataclass
class EnvStats:
    """Counters of a step's episodes (summed over dynamic-sampling rounds) and the step metrics they give."""

    episodes: int = 0
    turns: int = 0
    errors: int = 0
    generated_tokens: int = 0
    response_tokens: int = 0
    time_s: float = 0.0

    def add(self, other: EnvStats) -> None:
        for name in ("episodes", "turns", "errors", "generated_tokens", "response_tokens", "time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def metrics(self) -> dict[str, float]:
        return {"env_turns_mean": self.turns / max(self.episodes, 1), "env_errors": float(self.errors),
                "loss_token_frac": self.generated_tokens / max(self.response_tokens, 1),
                "env_time_s": self.time_s}


def turn_seed(first: int, turn: int) -> int:
    """Turn `turn`'s sampling seed of the episode whose first turn samples with `first` (a pure function)."""
    if turn == 0:
        return first
    digest = hashlib.blake2b(f"mpo-turn:{first}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def run_episodes(prompts: list, group_size: int, *, pool, renderer, generate: Callable, sampling: SamplingParams,
                 seeds: list[int], max_turns: int, context_length: int, want_routes: bool,
                 ) -> tuple[list[GenerateResult], list[float], EnvStats, int]:
    """`group_size` episodes per prompt; returns (rows, rewards, stats, engine restarts). `generate(requests)` ->
    (results, restarts) runs one batched engine call; `sampling` is each turn's template (its max_new_tokens the
    per-turn budget), `seeds` each episode's first-turn seed."""
    episodes = [Episode(prompt) for prompt in prompts for _ in range(group_size)]
    stats = EnvStats(episodes=len(episodes))
    clock = time.perf_counter()
    batch = pool.reset([p.fields if p.fields is not None else {"answer": p.answer} for p in
                        (e.prompt for e in episodes)])
    for i, (episode, out) in enumerate(zip(episodes, batch.results)):
        if i in batch.failed:
            episode.fail()
            continue
        episode.state, messages = out
        try:
            episode.prompt_ids = renderer.opening(messages, where=f"{episode.prompt.source}: reset()")
        except DataError as exc:
            log.warning("environment episode %d: %s", i, exc)
            episode.fail()
    errors_seen = list(pool.last_errors)
    stats.time_s += time.perf_counter() - clock
    restarts = 0
    for turn in range(max_turns):
        live = [i for i, e in enumerate(episodes) if not e.done]
        requests, asked = [], []
        for i in live:
            e = episodes[i]
            room = context_length - len(e.prompt_ids) - len(e.ids)
            if room < 1:  # no room for another token: the episode ends here (its last turn was cut by length)
                e.done = True
                continue
            params = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room),
                             sampling_seed=turn_seed(seeds[i], turn))
            requests.append(GenerateRequest(tuple(e.prompt_ids + e.ids), params, return_routed_experts=want_routes))
            asked.append(i)
        if not requests:
            break
        results, turn_restarts = generate(requests)
        restarts += turn_restarts
        texts = []
        for i, r in zip(asked, results):
            e = episodes[i]
            e.ids += r.output_ids
            e.loss_mask += [1.0] * len(r.output_ids)
            e.logprobs += r.output_logprobs
            stamped = r.meta.get("output_token_weight_versions")  # ints, -1 unknown (mpo.rollout.protocol)
            e.versions += list(stamped) if stamped is not None else [-1] * len(r.output_ids)
            e.routes, e.finish_reason = r.routed_experts, r.finish_reason
            e.turns += 1
            texts.append(renderer.encoder.decode(r.output_ids))
        clock = time.perf_counter()
        batch = pool.step([episodes[i].state for i in asked], texts)
        errors_seen += pool.last_errors
        for k, (i, out) in enumerate(zip(asked, batch.results)):
            e = episodes[i]
            if k in batch.failed:
                e.fail()
                continue
            e.state, observation, reward, done = out
            e.reward += reward
            if done or turn + 1 == max_turns:
                e.done = True
                continue
            last = e.ids[-1] if e.ids else None
            try:
                obs = renderer.observation(observation, last, where=f"{e.prompt.source}: step()")
            except DataError as exc:
                log.warning("environment episode %d: %s", i, exc)
                e.fail()
                continue
            if len(e.prompt_ids) + len(e.ids) + len(obs) + 1 > context_length:
                e.done = True  # no room for the observation and a next turn: the row ends with generated tokens
                continue
            e.ids += obs
            e.loss_mask += [0.0] * len(obs)
            e.logprobs += [0.0] * len(obs)
            e.versions += [e.versions[-1] if e.versions else -1] * len(obs)
        stats.time_s += time.perf_counter() - clock
    for e in episodes:
        e.state = None  # the environments are done with; their pickles are not kept
        stats.turns += e.turns
        stats.errors += e.error
        stats.generated_tokens += int(sum(e.loss_mask))
        stats.response_tokens += len(e.ids)
    if errors_seen:
        log.warning("environment %r: %d episode(s) failed; first: %s", pool.fn_name, stats.errors, errors_seen[0])
    return [e.result() for e in episodes], [e.reward for e in episodes], stats, restarts


def draw_episodes(config, task, prompts: list, seeds: list[int], want_routes: bool, *, generate: Callable,
                  context_length: int):
    """The trainer's draw of one round under rollout.env: `samples_per_prompt` episodes per prompt. Returns the
    fields of the trainer's Drawn row for row (results, rewards, texts, wall seconds, restarts, counters); the trainer
    builds the Drawn, so environments import nothing of the trainer."""
    r, G = config.rollout, config.rollout.samples_per_prompt
    started = time.perf_counter()
    pool, renderer = task.env
    turn = SamplingParams(temperature=r.temperature, top_p=r.top_p, stop_token_ids=task.stop_token_ids,
                          max_new_tokens=r.turn_new_tokens)
    results, rewards, stats, restarts = run_episodes(
        prompts, G, pool=pool, renderer=renderer, generate=generate, sampling=turn, seeds=seeds,
        max_turns=r.max_turns, context_length=context_length, want_routes=want_routes)
    texts = [renderer.encoder.tokenizer.decode(x.output_ids, skip_special_tokens=False) for x in results]
    return results, rewards, texts, time.perf_counter() - started, restarts, stats
