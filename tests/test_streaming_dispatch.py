"""Streaming dispatch (issue #31 item 3) against real mpo engine processes: requests go out in small calls, several in
flight per engine; a call's results are a function of the call alone (mpo's engine decodes each call as its own
batch), so an engine SIGKILLed mid-batch costs only its in-flight calls, which are re-sent, and the results equal an
uninterrupted run's token for token; rewards are scored as calls land, while others still generate, in request
order."""

from __future__ import annotations

import collections
import time

import pytest

from mpo.rollout.local_engine import LocalEngineProcess
from mpo.rollout.pool import EngineHandle, PoolConfig, RolloutPool
from mpo.rollout.protocol import GenerateRequest, SamplingParams

G = 4  # samples per prompt: a call holds whole prompt groups


def _requests(prompts: int, max_new_tokens: int = 16) -> list[GenerateRequest]:
    # Prompts of several lengths: a batch's prefill/decode split depends on its rows, so mixing calls would show.
    return [GenerateRequest(list(range(1 + p % 5, 5 + p % 5 + p % 3)),
                            SamplingParams(max_new_tokens=max_new_tokens, sampling_seed=1000 + p * G + j),
                            return_routed_experts=True)
            for p in range(prompts) for j in range(G)]


def _same(a, b) -> bool:
    """Token for token: ids, log-probs (bit-exact) and routes."""
    return (a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
            and a.routed_experts.tobytes() == b.routed_experts.tobytes())


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("engines")
    started = [LocalEngineProcess.mpo_engine(log_path=logs / f"engine{i}.log", num_layers=4, topk=2).start()
               for i in range(2)]
    yield started
    for engine in started:
        engine.stop()


class _Tracked:
    """Wraps an EngineClient's generate_batch: the calls in flight on it (by their requests' seeds), those that
    answered and those that failed."""

    def __init__(self, client) -> None:
        self.inflight: set[tuple[int, ...]] = set()
        self.answered: set[tuple[int, ...]] = set()
        self.failed: list[tuple[int, ...]] = []
        inner = client.generate_batch

        async def generate_batch(requests, **kwargs):
            key = tuple(r.sampling.sampling_seed for r in requests)
            self.inflight.add(key)
            try:
                results = await inner(requests, **kwargs)
                self.answered.add(key)
                return results
            except BaseException:
                self.failed.append(key)
                raise
            finally:
                self.inflight.discard(key)

        client.generate_batch = generate_batch
        self.undo = lambda: client.__dict__.pop("generate_batch", None)


def test_killed_engine_resends_only_its_inflight_calls_and_results_equal_an_uninterrupted_run(engines):
    requests = _requests(12)
    per_call, inflight = G, 3  # one prompt's group per call, three calls in flight per engine
    seeds = [r.sampling.sampling_seed for r in requests]

    def pool(*handles, concurrency=inflight):
        return RolloutPool(list(handles), PoolConfig(max_concurrency_per_engine=concurrency, backoff_s=0.1))

    reference = pool(EngineHandle(engines[0].client), EngineHandle(engines[1].client)).generate(
        requests, requests_per_call=per_call)
    # The same calls one at a time on one engine: a call's results do not depend on what else is in flight.
    alone = pool(EngineHandle(engines[1].client), concurrency=1).generate(requests, requests_per_call=per_call)
    assert all(_same(a, b) for a, b in zip(alone, reference))

    victim = engines[0]
    tracked = _Tracked(victim.client)
    seen: collections.Counter = collections.Counter()
    at_kill: list[set] = []

    def on_call(indices, results, url):
        seen.update(indices)
        if url == victim.url and not at_kill:  # the victim's first answer: kill it with its other calls in flight
            at_kill.append(set(tracked.inflight))
            victim.kill()

    interrupted = pool(EngineHandle(victim.client, restart=victim.restart), EngineHandle(engines[1].client))
    try:
        results = interrupted.generate(requests, requests_per_call=per_call, on_call=on_call)
    finally:
        tracked.undo()
    assert at_kill and at_kill[0], "the kill did not land while the victim had calls in flight"
    assert interrupted.engines[0].restarts == 1 and victim.client.healthy()
    # Every sample exactly once.
    assert len(results) == len(requests) and sorted(seen) == list(range(len(requests)))
    assert set(seen.values()) == {1}
    # Only the victim's failed calls were re-sent, each once per failure, whole (a call is a prompt's group).
    resent = [tuple(seeds[i] for i in r.indices) for r in interrupted.resent]
    assert all(r.url == victim.url for r in interrupted.resent)
    assert sorted(resent) == sorted(tracked.failed)
    # A call in flight when the kill was sent either had its answer already on the wire (it lands) or is re-sent: the
    # engine may finish a call between the client's bookkeeping and the SIGKILL, so "in flight" is a race by nature.
    assert resent, "the kill cost no call: it did not land while the victim had calls in flight"
    assert at_kill[0] <= set(resent) | tracked.answered, "a call in flight on the killed engine was lost"
    assert all(len(key) == per_call for key in resent)
    assert len(resent) <= 2 * inflight < len(requests) // per_call
    # The results equal the uninterrupted run's, token for token (log-probs and routes bit-exact).
    assert all(_same(a, b) for a, b in zip(results, reference))


def test_rewards_are_scored_while_calls_still_generate_in_request_order(engines, tmp_path):
    from mpo.config_checks import load_config
    from mpo.rewards import RewardPool
    from mpo.trainer.collect import Collector, _sampling_seed
    from mpo.trainer.phases import PhaseClock
    from mpo.trainer.tasks import Scored, ToyRun

    config = load_config(None, [f"rollout.samples_per_prompt={G}", "rollout.prompts_per_call=1",
                                "rollout.max_inflight_per_engine=2", "data.task=toy:reverse", "data.digits=3",
                                f"logging.out_dir={tmp_path}"])

    class PooledToy(ToyRun):
        """The toy task scored by reward worker processes (the registered text reward "toy" on the ids' text)."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self.pool = RewardPool("toy", timeout_s=30.0, workers=2)
            self.calls: list[tuple[float, float, int]] = []  # (start, end, responses) per score call

        def score(self, prompts, outputs) -> Scored:
            start = time.perf_counter()
            texts = [" ".join(map(str, out)) for out in outputs]
            rewards, errors = self.pool.score(texts, [" ".join(map(str, p.answer)) for p in prompts],
                                              [{} for _ in prompts])
            self.calls.append((start, time.perf_counter(), len(outputs)))
            return Scored(rewards, errors, texts)

    task = PooledToy(config)
    try:
        collector = Collector(config, task, retirement=None, clock=PhaseClock(), context_length=64,
                              advantages=None)
        collector.connect([(engines[1].client, None)])
        landed: list[float] = []
        inner = engines[1].client.generate_batch

        async def timed(requests, **kwargs):
            answers = await inner(requests, **kwargs)
            landed.append(time.perf_counter())
            return answers

        engines[1].client.generate_batch = timed
        try:
            drawn = collector._draw_round(step=3, round_=0, count=8)
        finally:
            engines[1].client.__dict__.pop("generate_batch", None)
        assert len(landed) == 8 and len(task.calls) == 8 and all(n == G for _, _, n in task.calls)
        # The first call was being scored before the last call returned: scoring overlapped generation. (Its start,
        # not its end: on a loaded host the last call can land while the first one's scoring finishes.)
        assert task.calls[0][0] < max(landed)
        # Request order, and the same values as scoring every response at the end.
        prompts = task.draw(3, 8)
        assert [r.prompt_ids for r in drawn.results] == [list(prompts[i // G].ids) for i in range(8 * G)]
        at_end = task.score([prompts[i // G] for i in range(8 * G)], [r.output_ids for r in drawn.results])
        assert drawn.rewards == at_end.rewards and drawn.texts == at_end.texts
        # And the results equal the same calls sent straight to the pool (each call its own batch).
        budget = min(config.rollout.max_new_tokens, task.max_answer_tokens or config.rollout.max_new_tokens)
        direct = RolloutPool([EngineHandle(engines[0].client)], PoolConfig(max_concurrency_per_engine=1)).generate(
            [GenerateRequest(r.prompt_ids, SamplingParams(max_new_tokens=budget, stop_token_ids=task.stop_token_ids,
                                                          sampling_seed=_sampling_seed(config.seed, 3, i)),
                             return_routed_experts=True)
             for i, r in enumerate(drawn.results)], requests_per_call=G)
        assert [r.output_ids for r in direct] == [r.output_ids for r in drawn.results]
        assert [r.output_logprobs for r in direct] == [r.output_logprobs for r in drawn.results]
    finally:
        task.close()
        task.pool.close()
