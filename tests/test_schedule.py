"""schedule.mode: the producer/consumer protocol of mpo.trainer.schedule, then the real thing (tests/test_demo.py runs
one_step_off and async demos end to end: real torchrun ranks, the mpo engine, in-flight weight updates, kill/resume).

Here `collect` is a stand-in for Trainer.collect (it stamps each token with the engine version it is called at, as
the mpo engine does), so the ordering rules are checked without processes: what a batch may be started at, when
the weight update may happen, and that the consumer never takes a token staler than the mode allows."""

from __future__ import annotations

import threading
import time

import pytest

from mpo.trainer.rows import Sample
from mpo.trainer.schedule import RolloutSchedule


def _run(mode: str, k: int, steps: int = 8, train_s: float = 0.01, gen_s: float = 0.005):
    """Drive the schedule like loop.run: take, 'train', before_sync, 'push' (the engine version), after_sync."""
    engine = {"version": 0}
    started_at: dict[int, int] = {}
    during_sync: list[bool] = []
    syncing = threading.Event()

    def collect(step: int, version: int):
        started_at[step] = version
        assert version == engine["version"], "the schedule's version is the engines' version"
        time.sleep(gen_s)
        first = engine["version"]
        time.sleep(gen_s)
        during_sync.append(syncing.is_set())
        return [Sample(ids=[1, 2, 3, 4], prompt_len=2, group=0, reward=0.0, versions=[first, engine["version"]])], {}

    logged: list[tuple[int, list]] = []
    schedule = RolloutSchedule(collect, mode, k, start=0, steps=steps, on_versions=lambda s, v: logged.append((s, v)))
    rows = []
    for step in range(steps):
        samples, metrics = schedule.take(step)
        time.sleep(train_s)
        schedule.before_sync()
        syncing.set()
        engine["version"] = step + 1
        time.sleep(0.002)
        syncing.clear()
        schedule.after_sync(step + 1)
        rows.append({**metrics, **schedule.step_metrics()})
    schedule.stop()
    return started_at, during_sync, logged, rows


def test_sync_generates_with_the_current_weights():
    started_at, _, logged, rows = _run("sync", 1)
    assert started_at == {s: s for s in range(8)}
    assert all(r["staleness_max"] == 0 and r["overlap_frac"] == 0 for r in rows)
    assert [s for s, _ in logged] == list(range(8))


def test_one_step_off_is_exactly_one_version_behind_and_updates_between_batches():
    started_at, during_sync, logged, rows = _run("one_step_off", 1)
    assert started_at == {0: 0, **{s: s - 1 for s in range(1, 8)}}
    assert not any(during_sync), "a weight update reached the engine while a batch was generating"
    assert max(r["staleness_max"] for r in rows) == 1
    assert max(r["overlap_frac"] for r in rows) > 0  # the next batch ran while the trainer trained


@pytest.mark.parametrize("k", [1, 2])
def test_async_never_hands_out_a_token_staler_than_k(k):
    started_at, _, logged, rows = _run("async", k, steps=10, train_s=0.02, gen_s=0.002)
    assert all(started_at[s] >= s - k for s in started_at)
    ages = [step - v for step, samples in logged for versions in samples for v in versions]
    assert ages and max(ages) <= k and all(r["staleness_dropped_samples"] == 0 for r in rows)
    # with fast generation the producer runs ahead to the limit: the bound is reached, not just respected
    assert max(ages) == k


def test_a_stale_sample_is_dropped():
    def collect(step: int, version: int):
        return [Sample(ids=[1, 2], prompt_len=1, group=0, reward=0.0, versions=[step - 3]),
                Sample(ids=[1, 2], prompt_len=1, group=0, reward=0.0, versions=[step])], {}

    schedule = RolloutSchedule(collect, "async", 2, start=5, steps=6)
    samples, metrics = schedule.take(5)
    schedule.stop()
    assert [s.versions for s in samples] == [[5]] and metrics["staleness_dropped_samples"] == 1


def test_producer_errors_reach_the_trainer():
    def collect(step: int, version: int):
        raise ConnectionError("engine gone")

    schedule = RolloutSchedule(collect, "async", 1, start=0, steps=3)
    with pytest.raises(RuntimeError, match="engine gone"):
        schedule.take(0)
    schedule.stop()


def test_a_dead_producer_process_is_one_line():
    """The producer process gone (mpo.trainer.producer): take raises ProducerDied, which ends the run with its one
    line (mpo.trainer.__main__), not a traceback."""
    from mpo.trainer.producer import ProducerDied

    def collect(step: int, version: int):
        raise ProducerDied("the rollout producer process (pid 7) was killed by SIGKILL")

    schedule = RolloutSchedule(collect, "one_step_off", 1, start=0, steps=3)
    with pytest.raises(ProducerDied, match=r"^rollout producer failed: .* \(pid 7\) was") as e:
        schedule.take(0)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    schedule.stop()


def test_versions_parse_and_bad_mode():
    from mpo.rollout.protocol import weight_version

    assert weight_version("12") == 12 and weight_version("default") is None and weight_version(None) is None
    with pytest.raises(ValueError, match="schedule.mode='bogus'; valid values: sync, one_step_off, async"):
        RolloutSchedule(lambda s, v: ([], {}), "bogus", 1, start=0, steps=1)


def test_colocate_needs_sync_mode():
    from mpo.config import RECIPES
    from mpo.config import ConfigError
    from mpo.config_checks import load_config

    with pytest.raises(ConfigError, match="rollout.colocate=true needs schedule.mode='sync' \\(got 'async'\\)"):
        load_config(RECIPES / "demo_cpu.yaml", ["rollout.colocate=true", "schedule.mode=async"])
    with pytest.raises(ConfigError, match="schedule.max_staleness=0; valid values: >= 1"):
        load_config(RECIPES / "demo_cpu.yaml", ["schedule.max_staleness=0"])
    with pytest.raises(ConfigError, match="schedule.mode='later'; valid values: 'sync', 'one_step_off', 'async'"):
        load_config(RECIPES / "demo_cpu.yaml", ["schedule.mode=later"])


@pytest.mark.parametrize("mode,k", [("one_step_off", 1), ("async", 2)])
def test_samples_log_is_the_batch_each_step_trained(mode, k):
    """samples.jsonl's rows come with their batch: off-policy the producer has collected the next batch (and its
    source's rows moved on) by the time a step trains, so rows read at log time would be the wrong step's (the
    rehearsal found step 0 never logged and the last step twice)."""
    source = {"rows": []}

    def collect(step: int, version: int):
        source["rows"] = [{"step": step}]  # what the collect source holds after its latest collect
        return [Sample(ids=[1, 2, 3], prompt_len=1, group=0, reward=0.0, versions=[version])], {}

    steps = 5
    schedule = RolloutSchedule(collect, mode, k, start=0, steps=steps, rows=lambda: source["rows"])
    logged = []
    for step in range(steps):
        schedule.take(step)
        time.sleep(0.01)  # the producer runs ahead meanwhile
        logged.append(schedule.samples_log)
        schedule.before_sync()
        schedule.after_sync(step + 1)
    schedule.stop()
    assert logged == [[{"step": s}] for s in range(steps)]


@pytest.mark.parametrize("mode, k", [("one_step_off", 1), ("async", 2)])
def test_checkpoint_keeps_the_rollout_state_of_the_batch_trained_last(mode, k):
    """Off-policy the producer draws ahead of training: at a checkpoint its own state (the data position) already
    counts batches no step trained, and a resume from it skipped their prompts (the rehearsal's resumed one_step_off
    run trained step 2's prompts at step 1). The checkpoint keeps the state read right after the batch it trained
    was drawn, so the resumed run draws the next batch again."""
    from mpo.trainer.loop import _trained_state

    source = {"position": 0}

    def collect(step: int, version: int):
        source["position"] += 1  # one batch's prompts drawn
        return [Sample(ids=[1, 2, 3], prompt_len=1, group=0, reward=0.0, versions=[version])], {}

    class Rollouts:  # the rollout side's own state: where the producer is now
        def state_dict(self):
            return dict(source)

    steps = 5
    schedule = RolloutSchedule(collect, mode, k, start=0, steps=steps, state=lambda: dict(source))
    kept, ahead = [], []
    for step in range(steps):
        schedule.take(step)
        schedule.before_sync()
        schedule.after_sync(step + 1)
        deadline = time.monotonic() + 5
        while source["position"] == step + 1 and step + 1 < steps and time.monotonic() < deadline:
            time.sleep(0.005)  # the producer draws the next batch meanwhile, as it does while a step checkpoints
        ahead.append(Rollouts().state_dict()["position"] > step + 1)
        kept.append(_trained_state(schedule, Rollouts())["position"])
    schedule.stop()
    assert any(ahead), "the producer never drew ahead: the test did not meet the case it is for"
    assert kept == [step + 1 for step in range(steps)]
