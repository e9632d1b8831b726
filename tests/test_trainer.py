"""The RL loop end to end on real megatron-core (2 gloo ranks, EP2) with a real mpo engine over HTTP."""

from __future__ import annotations

import json
import math

import pytest

from helpers import trainer_worker
from helpers.spawn import spawn_ranks
from mpo.algorithms import loss_names

LOSSES = [name for name in loss_names()]


@pytest.fixture(scope="module")
def every_loss_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("every_loss")
    spawn_ranks(2, trainer_worker.every_loss, str(out), LOSSES)
    return json.loads((out / "every_loss.json").read_text())


def test_first_step_train_vs_rollout_logprob_diff_is_logged_and_zero(every_loss_run):
    first = every_loss_run[LOSSES[0]]
    assert "train_rollout_logprob_absdiff" in first
    assert first["train_rollout_logprob_absdiff"] <= 1e-5  # mpo's engine scores with the trainer's own forward


def test_restarted_engine_serves_the_current_weights(every_loss_run):
    metrics = every_loss_run["after_engine_crash"]
    assert metrics["engine_restarts"] == 1.0
    assert metrics["train_rollout_logprob_absdiff"] <= 1e-5  # not the engine's initial weights


@pytest.mark.parametrize("loss", LOSSES + ["gspo+kl"])
def test_every_loss_runs_a_step(every_loss_run, loss):
    metrics = every_loss_run[loss]
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["nonfinite_skipped"] == 0
    assert metrics["sync_time_s"] > 0 and metrics["sync_bytes"] > 0  # every step's weights reached the engine
    if loss.endswith("+rs") or loss == "rspo":
        assert "rspo_gamma_mean" in metrics
    if loss == "gspo+kl":
        assert "kl_mean" in metrics


@pytest.fixture(scope="module")
def replay_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    spawn_ranks(2, trainer_worker.replay_modes, str(out))
    return json.loads((out / "replay.json").read_text())


def test_r3_reproduces_the_engines_logprobs_in_sync(replay_runs):
    # fp32 on both sides, same weights: replaying the engine's experts gives the engine's log-probs.
    assert replay_runs["r3_in_sync"]["train_rollout_logprob_absdiff"] <= 1e-5


def test_r3_with_a_lagging_engine_forces_routes_the_trainer_would_not_choose(replay_runs):
    none, r3 = replay_runs["none"], replay_runs["r3"]
    # The lagging engine routes some tokens differently from the trainer's natural choice, with and without R3
    # (agreement is measured on the natural choice, so R3 cannot hide it) ...
    assert none["routing/rollout_vs_old/exact_match"] < 1.0 and r3["routing/rollout_vs_old/exact_match"] < 1.0
    assert none["train_rollout_logprob_absdiff"] > 1e-4
    # ... and R3 overrode the router there: natural vs replayed disagree.
    assert r3["routing/old_replay/forced_frac"] > 0
    assert "routing/old_replay/forced_frac" not in none


def test_r2_replays_the_old_routes_in_the_update(replay_runs):
    r2 = replay_runs["r2"]
    # Two updates per step: the second runs after an optimizer step, where the router's own choice has moved.
    assert r2["routing/update_replay/forced_frac"] > 0
    assert r2["routing/old_vs_update/exact_match"] < 1.0


def test_rspo_gamma_under_r3_comes_from_the_replayed_routing(replay_runs):
    rspo = replay_runs["rspo_r3"]
    assert rspo["routing/update_replay/forced_frac"] > 0  # replay changes the routing, so the check can fail
    assert rspo["gamma_probe_vs_update_maxdiff"] <= 1e-6


ALGO_LAYOUTS = {"dp2xep2": [], "pp2": ["parallel.pipeline_parallel=2", "parallel.expert_parallel=1"]}


@pytest.fixture(scope="module", params=list(ALGO_LAYOUTS))
def algorithms_v2_run(tmp_path_factory, request):
    out = tmp_path_factory.mktemp(f"algorithms_v2_{request.param}")
    spawn_ranks(2, trainer_worker.algorithms_v2, str(out), ALGO_LAYOUTS[request.param])
    return json.loads((out / "algorithms_v2.json").read_text())


@pytest.mark.parametrize("name", list(trainer_worker.ALGORITHMS_V2))
def test_second_wave_algorithms_run_a_step(algorithms_v2_run, name):
    metrics = algorithms_v2_run[name]
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["nonfinite_skipped"] == 0
    # the engine-vs-trainer mismatch is measured every step, with or without a correction
    assert metrics["rollout_mismatch_k3"] >= 0 and "rollout_is_weight_mean" in metrics
    assert metrics["rollout_mismatch_k3"] > 0  # a bf16 engine: the mismatch the corrections are for
    if name.startswith("correction"):
        assert metrics["rollout_is_weight_mean"] != 1.0
    if name == "correction-mis_seq-gspo":
        assert 0 < metrics["rollout_masked_frac"] < 1  # a narrow band drops some rows, keeps others
    if name == "positive_nll":
        assert metrics["positive_nll"] > 0
    if name == "kl-k3_unbiased":
        assert metrics["kl_mean"] > 0
    if name in ("ppo-gae", "vapo"):  # the critic scored the rows and took a step of the clipped value loss
        assert math.isfinite(metrics["critic/value_loss"]) and metrics["critic/value_loss"] > 0
        assert metrics["critic/grad_norm"] > 0 and "critic/returns_mean" in metrics


def test_joined_old_logprob_forwards_give_each_micro_batch_its_own_results(tmp_path):
    """schedule.forward_micro_batch_size: the old-logprob pass joins consecutive micro-batches (of different widths
    here) into one forward; each micro-batch's log-probs and routing records (chosen and natural experts) must be
    those of its own forward, with and without R3 replay (the engine routes joined too). A size below a micro-batch
    joins nothing."""
    spawn_ranks(2, trainer_worker.joined_old_pass, str(tmp_path))
    results = json.loads((tmp_path / "joined.json").read_text())
    for replay in ("none", "r3"):
        out = results[replay]
        assert len(set(out["widths"])) > 1, out["widths"]  # the joined forwards pad some rows
        assert out["groups_3"] == [[i] for i in range(len(out["widths"]))]
        assert all(len(g) == 2 for g in out["groups_8"]), out["groups_8"]
        assert out["logp_equal_3"] and out["records_equal_3"] and out["records_equal_8"], out
        # A joined forward pads rows to a wider batch, and a matmul of another shape may sum in another order: a few
        # fp32 ULPs of the log-probs (one ULP is 5e-7 from |log p| = 4 up; CI saw 1.4e-6 once). A row given another
        # micro-batch's result would be off by O(1).
        assert out["logp_maxdiff_8"] <= 1e-5, out


def test_critic_value_loss_falls_on_fixed_targets(tmp_path):
    """The megatron critic (value head on the policy's body, DP2xEP2) regresses one step's GAE returns: its clipped
    value loss falls well below where it started (the zero-initialised head predicts V = 0)."""
    spawn_ranks(2, trainer_worker.critic_fits, str(tmp_path), 20)
    losses = json.loads((tmp_path / "critic.json").read_text())["value_loss"]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_reinforce_ema_keeps_its_baseline(algorithms_v2_run):
    state = algorithms_v2_run["ema_state"]["ema"]
    assert state["beta"] == 0.9 and 0 < state["baseline"] < 1


def test_retired_prompts_are_never_sampled_again_also_after_resume(tmp_path):
    """Threshold 0 retires every prompt once seen (a pass rate >= 0 always holds): no prompt comes back over 6 steps
    and a resume in between; without retirement, 24 draws from the 100 prompts repeat some (the control, with the
    run's fixed seeds)."""
    spawn_ranks(2, trainer_worker.retirement, str(tmp_path), 3)
    run = json.loads((tmp_path / "retirement.json").read_text())
    seen = [tuple(p) for step in run["sampled"] for p in step]
    assert len(run["sampled"]) == 6 and len(seen) == 6 * 4  # 4 prompts per step
    assert len(set(seen)) == len(seen), "a retired prompt was sampled again"
    assert run["retired_before_resume"] == 12 and run["retired_after_resume"] == 12
    control = [tuple(p) for step in run["sampled_without_retirement"] for p in step]
    assert len(set(control)) < len(control)


LOOP_LAYOUTS = {"tp2": ["parallel.tensor_parallel=2"], "pp2": ["parallel.pipeline_parallel=2"],
                # interleaved schedule: 2 chunks per stage, micro-batch counts padded to a multiple of PP
                "uneven_pp-vpp2": ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline_parallel=2"],
                # 4 layers as 1 + 3
                "uneven_pp-first1": ["parallel.pipeline_parallel=2", "parallel.num_layers_in_first_stage=1"]}


@pytest.mark.parametrize("layout", list(LOOP_LAYOUTS), ids=[f"loop-layout-{k}" for k in LOOP_LAYOUTS])
def test_loop_step_runs_at_layout(tmp_path, layout):
    """Rows of different lengths in one step: under TP (sequence parallel) and PP every micro-batch of a pass gets
    one [b, s] shape; before, TP2 failed in megatron's sequence split and PP2 on mismatched pipeline buffers."""
    spawn_ranks(2, trainer_worker.layout_step, str(tmp_path), LOOP_LAYOUTS[layout])
    metrics = json.loads((tmp_path / "layout.json").read_text())["step"]
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert metrics["train_rollout_logprob_absdiff"] <= 1e-5  # the engine (TP1) and the trainer agree


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_steps_are_skipped_then_the_run_stops_with_a_checkpoint(tmp_path, where):
    spawn_ranks(2, trainer_worker.nonfinite, str(tmp_path), where)
    result = json.loads((tmp_path / "nonfinite.json").read_text())
    assert [s["nonfinite_skipped"] for s in result["steps"]] == [1.0, 1.0]
    assert result["steps"][-1]["nonfinite_total"] == 2.0
    assert result["weights_unchanged"], "a non-finite step changed the weights"
    assert "2 consecutive steps had a non-finite loss" in result["stopped"]
    assert result["checkpoint"].endswith("step_2")
