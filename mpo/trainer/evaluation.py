"""Evaluation on held-out prompts during training (the `eval` config section), on rank 0 through the run's engines.

The prompts are drawn once, in a seeded order of their own (the toy tasks: prompts of another seed; files: the first
`eval.prompts` rows of a seeded order of `eval.task`), and every evaluation samples the same k responses per prompt
with the same seeds, so two evaluations differ only by the policy. Scored by the run's reward; a response passes when
its reward is 1.0. Metrics (k is the literal number): `eval/mean@k` (mean reward), `eval/pass@k` (the unbiased
estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code", over the k samples, averaged over
prompts), `eval/pass@1`, `eval/response_length_mean`, `eval/time_s`; per-prompt results go to eval.jsonl.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, Sequence

from mpo.config import TrainConfig
from mpo.trainer.collect import Collector, _sampling_seed, plain
from mpo.trainer.phases import PhaseClock
from mpo.trainer.tasks import make_task

EVAL_SEED_OFFSET = 104_729  # the evaluation's prompts and sampling seeds: apart from the run's (seed, step) ones


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them passing) passes:
    1 - C(n-c, k) / C(n, k), as the product form that stays exact for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


class Evaluator:
    """Rank 0's evaluation: the held-out prompts, generated through `engines` (EngineHandle fields, as
    EngineSet.handles) and scored as the rollouts are, by a Collector of its own (its own pool and scoring thread:
    the async schedule's producer collects meanwhile)."""

    def __init__(self, config: TrainConfig, engines: Sequence) -> None:
        e = config.eval
        self.config = config
        self.seed = config.seed + EVAL_SEED_OFFSET
        held_out = replace(config, seed=self.seed, data=replace(config.data, task=e.task or config.data.task))
        self.task = make_task(held_out, rank=0)
        count = e.prompts
        stream = getattr(getattr(self.task, "data", None), "stream", None)
        if stream is not None:  # a file with fewer rows than eval.prompts: each row once
            count = min(count, len(stream))
        self.prompts = self.task.draw(0, count)
        self.k = e.samples_per_prompt
        self.collector = Collector(config, self.task, retirement=None, clock=PhaseClock(), context_length=0,
                                   advantages=None)
        self.collector.connect(engines)

    def run(self, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Evaluate the engines' current policy; returns the metrics and the per-prompt rows of eval.jsonl."""
        e, k = self.config.eval, self.k
        started = time.perf_counter()
        # As the rollouts: calls of rollout.prompts_per_call prompts' k samples, scored as they land.
        results, scored, _, _ = self.collector.generate_scored(
            self.prompts, k, [_sampling_seed(self.seed, 0, i) for i in range(len(self.prompts) * k)],
            temperature=e.temperature, top_p=1.0, max_new_tokens=self.config.eval_new_tokens)
        seconds = time.perf_counter() - started
        rows, passes = [], []
        for i, prompt in enumerate(self.prompts):
            rewards = scored.rewards[i * k:(i + 1) * k]
            passed = sum(r == 1.0 for r in rewards)
            passes.append(passed)
            rows.append({"step": step, "prompt": self.task.describe(prompt), "answer": plain(prompt.answer),
                         "rewards": rewards, f"pass@{k}": pass_at_k(k, passed, k),
                         "response_lengths": [len(r.output_ids) for r in results[i * k:(i + 1) * k]]})
        lengths = [len(r.output_ids) for r in results]
        metrics = {f"eval/mean@{k}": sum(scored.rewards) / len(scored.rewards),
                   f"eval/pass@{k}": sum(pass_at_k(k, c, k) for c in passes) / len(passes),
                   "eval/pass@1": sum(pass_at_k(k, c, 1) for c in passes) / len(passes),
                   "eval/response_length_mean": sum(lengths) / len(lengths),
                   "eval/reward_errors": float(scored.errors), "eval/time_s": seconds}
        return metrics, rows

    def close(self) -> None:
        self.collector.scoring.shutdown(wait=True)
        self.task.close()


def due(config: TrainConfig, step: int) -> bool:
    """Whether the policy about to train RL step `step` (or, at step == schedule.steps, the final one) is evaluated."""
    every = config.eval.every
    return bool(every) and (step % every == 0 or step == config.schedule.steps)
