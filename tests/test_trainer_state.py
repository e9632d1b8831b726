"""The distributed optimizer and reshardable checkpoints (issue #14, parts 1-2), on real megatron-core over gloo.

One module fixture runs three jobs and the tests read their results:
  * a 2-rank job (its own process tree) that checkpoints step 1, then stalls inside the save of step 2 on rank 1,
    which the fixture kills with SIGKILL;
  * 4 ranks at TP2xEP2: the distributed optimizer against the plain one (3 steps from the same init), then the
    reference run: 2 steps, an async checkpoint (written while the run goes on), 2 more steps;
  * 2 ranks: the distributed optimizer against the plain one at DP2 and EP2; the TP2xEP2 checkpoint (saved with
    logging.checkpoint_format=fully_reshardable) resumed at EP2, PP2 and DP2, 2 steps each; the killed run resumed from
    its previous checkpoint; at DP2, a routine (dp_reshardable) save resumed at DP2 and refused at EP2, and an export
    save (the run's last: fully_reshardable) resumed at EP2 (issue #31 item 6).
The reference for every comparison is an independent run: the plain optimizer, or the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import state_worker
from helpers.spawn import spawn_ranks
from mpo.trainer.dist_checkpoint import STALL_ENV

SAVE_AT, MORE = 2, 2
TESTS = Path(__file__).parent


def _killed_run(out: Path) -> dict:
    """Run helpers.state_worker's killed job; SIGKILL the stalled rank; return what is left on disk."""
    env = dict(os.environ, **{STALL_ENV: "1:2"})
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    log = open(out.parent / "killed.log", "w")
    job = subprocess.Popen([sys.executable, "-m", "helpers.state_worker", str(out)], cwd=TESTS, env=env,
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stalled = out / "checkpoints" / "step_2.tmp" / "stalled"
    try:
        deadline = time.monotonic() + 300
        while not stalled.exists() or not stalled.read_text():
            if job.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the job never stalled in save (rc={job.returncode}): "
                                     + (out.parent / "killed.log").read_text()[-3000:])
            time.sleep(0.2)
        os.kill(int(stalled.read_text()), signal.SIGKILL)
        # torch.multiprocessing sees the dead rank and terminates the other one (stuck in a barrier)
        rc = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    root = out / "checkpoints"
    return {"rc": rc, "latest": (root / "latest").read_text().strip(), "dirs": sorted(p.name for p in root.iterdir()),
            "step1_loss": json.loads((out / "step1_loss.json").read_text())["loss"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_state")
    killed = _killed_run(out / "killed")
    spawn_ranks(4, state_worker.four_ranks, str(out), str(out / "ckpt"), SAVE_AT, MORE)
    spawn_ranks(2, state_worker.two_ranks, str(out), str(out / "ckpt"), MORE, str(out / "killed"))
    return {"killed": killed, **json.loads((out / "four_ranks.json").read_text()),
            **json.loads((out / "two_ranks.json").read_text())}


@pytest.mark.parametrize("layout", ["dp2", "ep2", "tp2ep2"])
def test_distributed_optimizer_equals_plain_optimizer(runs, layout):
    key = "distributed_vs_plain" if layout == "tp2ep2" else f"distributed_vs_plain_{layout}"
    result = runs[key]
    assert result["distributed_kind"] == "DistributedOptimizer"
    assert result["param_maxabs"] > 0.1  # the parameters are real and trained, not zeros
    assert result["param_maxdiff"] <= 1e-6, result
    assert result["losses_distributed"][-1] < result["losses_distributed"][0]  # it trains


@pytest.mark.parametrize("layout", ["ep2", "pp2", "dp2"])
def test_reshard_tp2ep2_checkpoint_resumes_at(runs, layout):
    """Saved at TP2xEP2 (distributed optimizer), resumed at another layout: the next steps' losses are the
    uninterrupted run's."""
    resumed = runs[f"resumed_{layout}"]
    assert runs["latest_while_saving"] == "None"  # the async save was not committed before it finished
    assert resumed["start"] == SAVE_AT
    assert resumed["optimizer"] == "DistributedOptimizer"
    reference = runs["reference_losses"]
    assert len(resumed["losses"]) == len(reference) == MORE
    for got, want in zip(resumed["losses"], reference):
        assert abs(got - want) <= 1e-5, (resumed["losses"], reference)


def test_reshard_kill_during_save_resumes_from_previous_checkpoint(runs):
    """SIGKILL of a rank inside the save of step 2 (after its shards were written, before the commit): `latest`
    still names step_1, the partial step_2.tmp is never selected, and resuming reproduces step 1 bit for bit."""
    killed = runs["killed"]
    assert killed["rc"] != 0
    assert killed["latest"] == "step_1"
    assert "step_2" not in killed["dirs"] and "step_2.tmp" in killed["dirs"]
    resumed = runs["resumed_after_kill"]
    assert resumed["latest"].endswith("step_1") and resumed["start"] == 1
    assert resumed["loss"] == killed["step1_loss"]


def test_hardening_damaged_newest_checkpoint_falls_back_to_the_previous_intact_one(runs):
    """The newest checkpoint lost a shard file (`latest` names it): the resume says so and continues from the
    previous intact checkpoint (step 1 here, reproducing its loss), instead of failing or restarting at step 0."""
    resumed = runs["damaged"]
    assert "error" not in resumed, resumed
    assert resumed["start"] == 1 and resumed["loss"] == runs["killed"]["step1_loss"]


def test_hardening_another_models_checkpoint_is_one_line(runs):
    """A run of a 2-layer model over a 4-layer model's checkpoint, with nothing older to fall back to: one line
    naming a tensor whose saved shape differs, raised before any data is read."""
    error = runs["other_model"].get("error", "")
    assert error.startswith("CheckpointError: ") and "\n" not in error, runs["other_model"]
    assert "another model's checkpoint" in error and "no older checkpoint" in error, error


def test_dp_reshardable_routine_save_resumes_bit_exact_at_its_layout(runs):
    """A routine save with the distributed optimizer (DP2) is dp_reshardable by default; resumed at the same layout
    the next steps' losses are the uninterrupted run's bit for bit (Adam's moments and step count restored)."""
    dp = runs["dp_reshardable"]
    assert dp["routine"]["formats"] == {"": "dp_reshardable"}
    assert dp["resumed_same"]["start"] == 2
    assert dp["resumed_same"]["losses"] == dp["reference"]


def test_dp_reshardable_gathers_no_adam_state_on_one_rank(runs):
    """Reference: Adam's state is 12 bytes per parameter (fp32 master copy and two moments). dp_reshardable: the
    two DP ranks write shard files of about the same size, neither holding the whole state; fully_reshardable (the
    export) gathers it all onto DP rank 0, whose file holds at least that much. Same content in both: the totals
    agree."""
    dp = runs["dp_reshardable"]
    adam = 12 * dp["params"]
    routine, export = dp["routine"]["files"], dp["export"]["files"]
    assert max(routine) <= 1.1 * min(routine), routine
    assert max(routine) < adam, (routine, adam)
    assert export[0] >= adam and export[0] >= 2 * export[1], (export, adam)
    assert abs(sum(routine) - sum(export)) <= 0.05 * sum(export), (routine, export)


def test_dp_reshardable_at_another_layout_is_one_line(runs):
    """The dp_reshardable checkpoint resumed at EP2 (saved at DP2, EP1): one line naming the format, both layouts and
    the way out, raised before any data is read."""
    error = runs["dp_reshardable"]["resumed_other"].get("error", "")
    assert error.startswith("CheckpointError: ") and "\n" not in error, error
    assert "dp_reshardable" in error and "EP=1" in error and "EP=2" in error, error
    assert "logging.checkpoint_format=fully_reshardable" in error, error


def test_export_save_is_fully_reshardable_and_reshards(runs):
    """The run's last save (schedule.steps reached) is fully_reshardable whatever logging.checkpoint_format says, and
    resumes at another layout (DP2 -> EP2) with the uninterrupted run's next losses."""
    dp = runs["dp_reshardable"]
    assert dp["export"]["formats"] == {"": "fully_reshardable"}
    resumed = dp["export_resumed_ep2"]
    assert resumed["start"] == 2
    for got, want in zip(resumed["losses"], dp["reference"], strict=True):
        assert abs(got - want) <= 1e-5, (resumed["losses"], dp["reference"])


def test_synchronous_saves_start_no_writer_process(monkeypatch):
    """megatron's torch_dist writer returns its results through a queue: a synchronous save (CPU's default) gets a
    plain in-process queue, and only an async save starts the multiprocessing Manager (a spawned interpreter that
    cost every run's first save ~2.5 s), which then serves every later save."""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mpo.trainer.dist_checkpoint import _writer_results_queue

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    monkeypatch.setattr(filesystem_async, "_manager", None, raising=False)
    before = set(multiprocessing.active_children())
    _writer_results_queue(async_save=False)
    assert isinstance(filesystem_async._results_queue, queue.Queue)
    assert set(multiprocessing.active_children()) == before
    _writer_results_queue(async_save=True)
    manager_queue = filesystem_async._results_queue
    try:
        assert not isinstance(manager_queue, queue.Queue) and set(multiprocessing.active_children()) - before
        _writer_results_queue(async_save=False)  # a Manager queue serves synchronous saves too
        assert filesystem_async._results_queue is manager_queue
    finally:
        filesystem_async._manager.shutdown()


def test_adam_step_count_of_a_resumed_run_is_read_where_torch_adam_keeps_it():
    """A resumed DistributedOptimizer's param groups carry the checkpoint's step count, which torch Adam (counting per
    parameter) never updates: one step after resuming the two disagreed and every save was refused (found by the
    rehearsal). The count is read per parameter where Adam keeps it, from the group only where fused Adam does."""
    from types import SimpleNamespace

    import torch

    from mpo.trainer.dist_checkpoint import optimizer_step

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    adam = torch.optim.Adam(params, lr=0.1)
    for _ in range(2):
        sum(p.sum() for p in params).backward()
        adam.step()
    adam.param_groups[0]["step"] = 1  # the resumed checkpoint's count, left behind by one step
    assert optimizer_step(SimpleNamespace(optimizer=adam)) == 2
    fused_like = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    fused_like.param_groups[0]["step"] = 7  # no per-parameter count: the group's is the count
    assert optimizer_step(SimpleNamespace(optimizer=fused_like)) == 7
