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
    assert metrics["sync_time_s"] > 0 if "sync_time_s" in metrics else True
    if loss.endswith("+rs") or loss == "rspo":
        assert "rspo_gamma_mean" in metrics
    if loss == "gspo+kl":
        assert "kl_mean" in metrics


def test_r3_replays_engine_routes_end_to_end(tmp_path):
    spawn_ranks(2, trainer_worker.replay_modes, str(tmp_path))
    runs = json.loads((tmp_path / "replay.json").read_text())
    key = "routing/rollout_vs_old/exact_match"
    # The lagging engine routes some tokens differently from the trainer ...
    assert runs["none"][key] < 1.0
    assert runs["none"]["train_rollout_logprob_absdiff"] > 1e-3
    # ... and with R3 the old forward uses exactly the engine's experts.
    assert runs["r3"][key] == 1.0
    # R2 replays the old forward's routes in the update: old vs update agree fully.
    assert runs["r2"]["routing/old_vs_update/exact_match"] == 1.0


def test_nonfinite_steps_are_skipped_then_the_run_stops_with_a_checkpoint(tmp_path):
    spawn_ranks(2, trainer_worker.nonfinite, str(tmp_path))
    result = json.loads((tmp_path / "nonfinite.json").read_text())
    assert [s["nonfinite_skipped"] for s in result["steps"]] == [1.0, 1.0]
    assert result["steps"][-1]["nonfinite_total"] == 2.0
    assert result["weights_unchanged"], "a non-finite step changed the weights"
    assert "2 consecutive steps had a non-finite loss" in result["stopped"]
    assert result["checkpoint"].endswith("step_2")
