"""Rank 0's collection: prompts -> requests -> one long-lived RolloutPool -> scored samples (rewards shaped,
advantages computed, groups filtered): the step's batch. The schedule (mpo.trainer.schedule) wraps `collect`."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from mpo.rollout.protocol import GenerateRequest, SamplingParams, token_versions
from mpo.trainer.dynamic_sampling import Drawn, Sampled, sample_varied
from mpo.trainer.rows import Sample
from mpo.trainer.tasks import Scored

if TYPE_CHECKING:
    from mpo.config import TrainConfig

log = logging.getLogger(__name__)


def _sampling_seed(seed: int, step: int, index: int, round_: int = 0) -> int:
    """Per-sample seed: a pure function of (run seed, step, sample, dynamic-sampling round), so resumed runs resample
    identically. Round 0 keeps the original formula (runs without dynamic sampling are unchanged); later rounds hash
    their coordinates, so no round shares seeds with another round or step."""
    if round_ == 0:
        return (seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)
    digest = hashlib.blake2b(f"mpo-sampling:{seed}:{step}:{round_}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def plain(answer):
    """A prompt's answer as JSON writes it (a sequence as a list)."""
    return answer if isinstance(answer, (str, int, float)) or answer is None else list(answer)


def requests_per_call(n: int, group: int, engines: int, prompts_per_call: int | None) -> int:
    """Requests per /generate call: `prompts_per_call` groups of `group` (a prompt's samples stay together), never
    more than an engine's even share of the `n` requests (every engine gets work); None: that share. A function of
    the config and the batch's size only, so a call's composition is the same on every run."""
    groups = -(-n // max(group, 1))
    share = max(1, -(-groups // max(engines, 1)))
    return max(group, 1) * (share if prompts_per_call is None else min(prompts_per_call, share))


class StreamingScorer:
    """Scores calls' results on `executor` (Collector.scoring) as they land (`submit`, the pool's on_call), while the
    others still generate; `wait` gives one Scored of all `n` requests in request order, the same values as scoring
    them all at the end (a reward is a function of its own response). `score(indices, results)` -> Scored runs on
    that one thread only (a RewardPool is not thread-safe; one caller at a time is fine)."""

    def __init__(self, n: int, score, executor) -> None:
        self.n, self.score, self._executor = n, score, executor
        self._futures: list = []

    def submit(self, indices: list[int], results: list, url: str = "") -> None:
        self._futures.append((list(indices), self._executor.submit(self.score, indices, results)))

    def wait(self):
        rewards: list = [None] * self.n
        texts: list | None = [None] * self.n
        errors = 0
        for indices, future in self._futures:
            scored = future.result()
            errors += scored.errors
            for k, i in enumerate(indices):
                rewards[i] = scored.rewards[k]
                if texts is not None:
                    texts[i] = None if scored.texts is None else scored.texts[k]
            if scored.texts is None:
                texts = None
        missing = [i for i, r in enumerate(rewards) if r is None]
        if missing:
            raise RuntimeError(f"scoring: {len(missing)} of {self.n} responses were never scored")
        return Scored(rewards, errors, texts)

    def reset(self) -> None:
        """Forget every call scored so far (the same requests are generated again, mpo.rollout.pool.StaleEngines)."""
        self.close()
        self._futures = []

    def close(self) -> None:
        """Cancel what has not started and wait for what has (the scorer's thread is free again)."""
        for _, future in self._futures:
            future.cancel()
        for _, future in self._futures:
            if not future.cancelled():
                future.exception()  # waits; an error was raised by wait() already, or the rollout failed first


class EngineBusy:
    """Per engine, the union of its calls' spans (receipt to last response, from each response's e2e_latency)."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}

    def add(self, url: str, results: list) -> None:
        end = time.perf_counter()
        latency = max((r.meta.get("e2e_latency") or 0.0 for r in results), default=0.0)
        self.spans.setdefault(url, []).append((end - latency, end))

    def seconds(self) -> float:
        best = 0.0
        for spans in self.spans.values():
            total, reach = 0.0, float("-inf")
            for start, end in sorted(spans):
                if end > reach:
                    total += end - max(start, reach)
                    reach = end
            best = max(best, total)
        return best


class Collector:
    """Rank 0's rollouts for the trainer: `config` (its algorithm section may change: set_algorithm), the run's
    `task` and prompt `retirement` (shared with the trainer's checkpoint), `clock` for phase times and the model's
    `context_length` (multi-turn episodes). connect() gives it the engines, as one RolloutPool for the whole run."""

    def __init__(self, config: TrainConfig, task, *, retirement, clock, context_length: int, advantages) -> None:
        self.config, self.task, self.retirement, self.clock = config, task, retirement, clock
        self.context_length, self.advantages = context_length, advantages
        self.pool = None
        self.republish = None  # sync mode: Distributor.republish, for engines all restarted mid-rollout (stale)
        # The one thread its streamed responses are scored on: long-lived, because a reward worker it restarts dies
        # with the thread that started it (PR_SET_PDEATHSIG, mpo.rewards.pool).
        self.scoring = ThreadPoolExecutor(1, thread_name_prefix="mpo-scoring")
        self.samples_log: list[dict] = []  # a few decoded responses of the last collect (samples.jsonl)

    def connect(self, engines: list) -> None:
        """Use these engines, EngineHandle fields (client, restart, current), from now on."""
        from mpo.rollout.pool import EngineHandle, PoolConfig, RolloutPool

        r = self.config.rollout
        self.pool = RolloutPool([EngineHandle(*engine) for engine in engines],
                                PoolConfig(request_timeout_s=r.request_timeout_s,
                                           max_concurrency_per_engine=r.max_inflight_per_engine))

    def set_algorithm(self, config: TrainConfig, advantages) -> None:
        self.config, self.advantages = config, advantages

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollouts (JSON): the advantage estimator's, the prompt retirement's and the
        task's (its data position) states."""
        return {"advantage_state": self.advantages.state_dict(),
                "retirement": self.retirement.state_dict() if self.retirement else None,
                "task": self.task.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.advantages.load_state_dict(state.get("advantage_state") or {})
        if self.retirement is not None and state.get("retirement"):
            self.retirement.load_state_dict(state["retirement"])
        self.task.load_state_dict(state.get("task") or {})

    def collect(self, step: int, version: int | None = None) -> tuple[list[Sample], dict[str, float]]:
        """Step `step`'s batch from the engines, which hold policy `version` (default: `step`) when it is submitted;
        each sample records the version of each token (the engine's per-token stamps when it returns them).

        With algorithm.dynamic_sampling, further rounds of prompt groups are drawn until data.prompts_per_step of
        them have non-zero reward variance (mpo.trainer.dynamic_sampling); advantages are computed over the kept
        groups only, as DAPO does."""
        version = step if version is None else version
        cfg = self.config
        G, wanted = cfg.rollout.samples_per_prompt, cfg.data.prompts_per_step
        draw = functools.partial(self._draw_round, step)  # (round, count) -> Drawn
        if cfg.algorithm.dynamic_sampling:
            outcome = sample_varied(draw, wanted, cfg.algorithm.max_sampling_rounds)
            if outcome.exhausted:
                log.warning("step %d: %d of %d prompt groups with non-zero reward variance after "
                            "algorithm.max_sampling_rounds=%d rounds (%d groups drawn); training on those", step,
                            len(outcome.batch), wanted, outcome.rounds, len(outcome.drawn))
        else:
            first = draw(0, wanted)
            outcome = Sampled(first, first, 1, False)
        batch, drawn = outcome.batch, outcome.drawn
        self.samples_log = self._sample_rows(step, drawn)
        results, rewards = batch.results, batch.rewards
        truncated = [r.finish_reason.get("type") == "length" for r in results]
        groups = torch.arange(len(results)) // G
        keep = torch.ones(len(results), dtype=torch.bool)
        advantages: list = []
        if results:  # empty only when dynamic sampling found no varied group
            # Over the step's whole batch (every DP rank's share): global whitening and group baselines.
            advantages, zero_variance = self.advantages(torch.tensor(rewards, dtype=torch.float64), groups,
                                                        [len(r.output_ids) for r in results],
                                                        [r.meta.get("loss_mask") for r in results])
            if cfg.algorithm.filter_zero_variance:
                keep = ~zero_variance  # per response: its group's rewards were all equal
        if cfg.algorithm.overlong_filter:  # DAPO: a truncated response gets no loss (it still counts in its group)
            keep &= ~torch.tensor(truncated, dtype=torch.bool)
        samples = [Sample(ids=r.prompt_ids + r.output_ids, prompt_len=len(r.prompt_ids), group=int(groups[i]),
                          reward=rewards[i], advantage=advantages[i],
                          rollout_logprobs=r.output_logprobs, routes=r.routed_experts,
                          loss_mask=r.meta.get("loss_mask"),
                          # per token from the engine (SGLang: its weight_versions spans); unknown (-1) or missing: the
                          # version at submission, the oldest possible
                          versions=token_versions(r.meta.get("output_token_weight_versions"), version,
                                                  len(r.output_ids)))
                   for i, r in enumerate(results) if keep[i] and r.output_ids]  # an episode failed at reset has none
        # Reward and length metrics describe everything generated this step (every round): the policy's behaviour,
        # comparable with and without dynamic sampling; kept_samples_frac is of the batch a step should train on.
        all_rewards = drawn.rewards
        lengths = [len(r.output_ids) for r in drawn.results]
        all_truncated = [r.finish_reason.get("type") == "length" for r in drawn.results]
        metrics = {
            "reward_mean": sum(all_rewards) / len(all_rewards),
            "reward_exact_frac": sum(r == 1.0 for r in all_rewards) / len(all_rewards),
            "response_length_mean": sum(lengths) / len(lengths),
            "kept_samples_frac": len(samples) / (wanted * G),
            "rollout_time_s": drawn.rollout_s,
            "rollout_tokens_per_s": sum(lengths) / max(drawn.rollout_s, 1e-9),
            "engine_restarts": float(drawn.restarts),
            "reward_errors": float(drawn.errors),
            "truncated_frac": sum(all_truncated) / len(all_truncated),
        }
        if drawn.env is not None:
            metrics.update(drawn.env.metrics())
        if cfg.algorithm.dynamic_sampling:
            metrics.update(sampling_rounds=float(outcome.rounds), sampling_groups_drawn=float(len(drawn)),
                           sampling_exhausted=float(outcome.exhausted))
        if cfg.algorithm.overlong_buffer:
            metrics["overlong_penalty_mean"] = sum(drawn.penalties) / len(drawn.penalties)
        if getattr(self.task, "dropped_long", None) is not None:
            metrics["data_dropped_long_prompts"] = float(self.task.dropped_long)
        if self.retirement is not None:
            metrics["retired_prompts"] = float(len(self.retirement.retired))
        return samples, metrics

    def _draw_round(self, step: int, round_: int, count: int):
        """Draw `count` prompt groups (round `round_` of the step: its own prompts and sampling seeds), generate G
        responses each (multi-turn episodes under rollout.env) and score them; prompt retirement sees every drawn
        group."""
        cfg = self.config
        G = cfg.rollout.samples_per_prompt
        with self.clock("prompt_draw"):
            prompts = self.task.draw(step, count, self.retirement, round_=round_)
        want_routes = cfg.algorithm.replay == "r3" or cfg.rollout.engine == "mpo"
        seeds = [_sampling_seed(cfg.seed, step, i, round_) for i in range(len(prompts) * G)]
        if cfg.rollout.env is not None:  # multi-turn episodes with an environment (mpo.envs.rollout)
            from mpo.envs.rollout import draw_episodes

            results, rewards, texts, rollout_s, restarts, stats = draw_episodes(
                cfg, self.task, prompts, seeds, want_routes, generate=self._generate,
                context_length=self.context_length)
            drawn = Drawn(G, list(prompts), results, rewards, [0.0] * len(results), texts, 0, rollout_s, restarts,
                          env=stats)
        else:
            results, scored, restarts, rollout_s = self.generate_scored(
                prompts, G, seeds, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.rollout.max_new_tokens, routes=want_routes)
            penalties = self._overlong_penalties(results)
            rewards = [r + p for r, p in zip(scored.rewards, penalties)]
            drawn = Drawn(G, list(prompts), list(results), rewards, penalties, scored.texts, scored.errors, rollout_s,
                          restarts)
        if self.retirement is not None:
            self.retirement.observe(prompts, [sum(r == 1.0 for r in drawn.rewards[p * G:(p + 1) * G]) / G
                                              for p in range(len(prompts))])
        return drawn

    def generate_scored(self, prompts: list, group: int, seeds: list[int], *, temperature: float, top_p: float,
                        max_new_tokens: int, routes: bool = False):
        """`group` responses to each of `prompts` (request i: prompt i // group, sampling seed seeds[i]), each at most
        `max_new_tokens` (and the task's answer budget) long. Each call's responses are scored (the task's reward
        workers) as soon as the call returns, while the others still generate; the scores are put back in request
        order. Returns the results, their Scored, the engine restarts and the seconds until the last response."""
        if self.task.max_answer_tokens is not None:
            max_new_tokens = min(max_new_tokens, self.task.max_answer_tokens)
        started = time.perf_counter()
        with self.clock("request_build"):
            requests = [GenerateRequest(list(prompts[i // group].ids), SamplingParams(
                temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                stop_token_ids=self.task.stop_token_ids, sampling_seed=seed), return_routed_experts=routes)
                for i, seed in enumerate(seeds)]
        scorer = StreamingScorer(len(requests), lambda indices, results: self.task.score(
            [prompts[i // group] for i in indices], [r.output_ids for r in results]), self.scoring)
        try:
            results, restarts = self._generate(requests, group=group, on_call=scorer.submit, on_rerun=scorer.reset)
            seconds = time.perf_counter() - started
            with self.clock("scoring"):  # what is left of the scoring once generation has ended
                scored = scorer.wait()
        finally:
            scorer.close()
        return results, scored, restarts, seconds

    def _generate(self, requests: list[GenerateRequest], *, group: int | None = None,
                  on_call=None, on_rerun=None) -> tuple[list, int]:
        """Generate in calls of rollout.prompts_per_call groups of `group` consecutive requests (default: a prompt's
        samples_per_prompt responses), rollout.max_inflight_per_engine calls in flight per engine. mpo's engine
        decodes each call as its own batch, so each result is a function of its call (fixed by the requests' order)
        and the weights: rollouts are a pure function of (weights, seeds) and a resumed run reproduces an
        uninterrupted one bit for bit. `on_call(indices, results, url)` hears of each call as it lands; `on_rerun()`
        before all the requests go out again, after a re-publish for engines all restarted mid-rollout. Returns the
        results in request order and the engine restarts it took."""
        from mpo.rollout.pool import StaleEngines

        pool = self.pool
        group = self.config.rollout.samples_per_prompt if group is None else group
        per_call = requests_per_call(len(requests), group, len(pool.engines), self.config.rollout.prompts_per_call)
        busy = EngineBusy()
        started = time.perf_counter()

        def landed(indices, results, url) -> None:
            busy.add(url, results)
            if on_call is not None:
                on_call(indices, results, url)

        restarts = 0
        try:
            results = pool.generate(requests, requests_per_call=per_call, on_call=landed)
        except StaleEngines as exc:
            if self.republish is None:
                raise
            restarts = sum(h.restarts for h in pool.engines)
            log.warning("%s: publishing the weights again, then the same requests again", exc)
            self.republish()
            busy = EngineBusy()
            if on_rerun is not None:  # the calls that landed before are generated (and heard of) again
                on_rerun()
            results = pool.generate(requests, requests_per_call=per_call, on_call=landed)
        # The engines' own time: per engine, the union of its calls' spans from receipt to the last response
        # (e2e_latency, its clock), the busiest engine's; the rest of the rollout is the client's (HTTP, JSON,
        # decoding the arrays) and the queue's.
        wall = time.perf_counter() - started
        engine_s = min(busy.seconds(), wall)
        self.clock.add("engine", engine_s)
        self.clock.add("http_and_decode", max(wall - engine_s, 0.0))
        return results, restarts + sum(h.restarts for h in pool.engines)

    def _overlong_penalties(self, results: list) -> list[float]:
        """DAPO's soft overlong punishment per response (0 everywhere when algorithm.overlong_buffer is 0)."""
        from mpo.rewards.shaping import overlong_penalty

        buffer = self.config.algorithm.overlong_buffer
        if not buffer:
            return [0.0] * len(results)
        return [overlong_penalty(len(r.output_ids), self.config.response_tokens, buffer) for r in results]

    def _sample_rows(self, step: int, drawn) -> list[dict]:
        """The first data.samples_logged responses of the step, decoded (text tasks), for samples.jsonl."""
        G = self.config.rollout.samples_per_prompt
        rows = []
        for i in range(min(self.config.data.samples_logged, len(drawn.results))):
            prompt, result = drawn.prompts[i // G], drawn.results[i]
            rows.append({"step": step, "prompt": self.task.describe(prompt),
                         "response": drawn.texts[i] if drawn.texts is not None else result.output_ids,
                         "answer": plain(prompt.answer), "reward": drawn.rewards[i],
                         "finish": result.finish_reason.get("type"),
                         "source": getattr(prompt, "source", None)})
        return rows
