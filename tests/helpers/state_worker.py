"""Per-rank bodies of the optimizer/checkpoint tests (tests/test_trainer_state.py): the real Trainer (megatron model,
DDP, optimizer, checkpoints) on gloo ranks, trained with teacher-forced steps on the demo task (no engine: the
checkpoint does not care where the batch came from, and this keeps the runs small)."""

from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {  # name -> config overrides (on top of the demo recipe, one rank since issue #32; world_size is set)
    "tp2ep2": ["world_size=4", "parallel.tensor_parallel=2", "parallel.expert_parallel=2"],
    "ep2": ["parallel.expert_parallel=2"],
    "dp2": ["parallel.expert_parallel=1"],
    "pp2": ["parallel.pipeline_parallel=2", "parallel.expert_parallel=1"],
    "cp2": ["parallel.context_parallel=2", "parallel.expert_parallel=1"],
}
PROMPTS_PER_STEP = 16
# trainer -> its rollout side (mpo.trainer.rollouts), built beside it as the run loop does: the task draws the prompts
# and its state goes into every checkpoint
_ROLLOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_trainer(out_dir: str, layout: str, *, distributed_optimizer: bool, extra: list[str] = ()):
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.trainer.rollouts import Rollouts
    from mpo.trainer.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    config = load_config(RECIPES / "demo_cpu.yaml", [f"logging.out_dir={out_dir}", f"world_size={world}",
                                                     "schedule.micro_batch_size=8",
                                                     f"parallel.distributed_optimizer={distributed_optimizer}",
                                                     "schedule.steps=100", *LAYOUTS[layout], *extra])
    trainer = Trainer(config)
    _ROLLOUTS[trainer] = Rollouts.beside(trainer)
    return trainer


def save(trainer, step: int) -> None:
    """trainer.save with its rollout side's state, as the run loop saves."""
    trainer.save(step, _ROLLOUTS[trainer].state_dict())


def resume(trainer) -> int:
    """trainer.resume, its rollout side loading what the checkpoint kept; the step to continue from."""
    start, rollout_state = trainer.resume()
    _ROLLOUTS[trainer].load_state_dict(rollout_state)
    return start


def train_step(trainer, step: int) -> float:
    """One teacher-forced optimizer step on answers to the task's prompts of `step` (a pure function of seed and
    step); returns the step's loss over the whole batch (every DP rank's share), on every rank."""
    from mpo.models.forward import run_microbatches
    from mpo.trainer.rows import Sample, rank_microbatches

    cfg = trainer.config
    prompts = _ROLLOUTS[trainer].task.prompts(cfg.seed + 104729, step, PROMPTS_PER_STEP)
    samples = [Sample(ids=list(p.ids + p.answer), prompt_len=len(p.ids), group=0, reward=0.0) for p in prompts]
    dp_rank, dp_size = trainer._dp()
    mbs = rank_microbatches(samples, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=cfg.schedule.micro_batch_size,
                            seq_len=trainer.uniform_seq_len(samples))
    total = float(sum(len(p.answer) for p in prompts))

    def loss_fn(mb, logprobs, entropy):
        loss = -(logprobs * mb.extras["mask"]).sum() / total
        return loss, {"loss": loss.detach()}

    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    outs = run_microbatches(trainer.model, mbs, vocab_size=trainer.model_cfg.vocab_size, loss_fn=loss_fn)
    trainer.optimizer.step()
    # The last stage's TP rank 0 of each DP rank holds that rank's share of the loss (every CP rank holds the whole
    # share: CP rank 0 counts it); the sum over ranks is the batch's.
    counts = trainer.ps.get_tensor_model_parallel_rank() == 0 and trainer.ps.get_context_parallel_rank() == 0
    mine = sum(float(o["loss"]) for o in outs) if outs and counts else 0.0
    total_loss = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(total_loss)
    return float(total_loss)


def local_params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.gpt.state_dict().items() if isinstance(v, torch.Tensor)}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over this rank's shards, maximised over ranks (no full-model gather)."""
    local = max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)
    out = torch.tensor([local])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


def distributed_vs_plain(out_dir: str, layout: str, steps: int = 3) -> dict:
    """The same steps from the same init with the plain and with the distributed optimizer: parameter difference."""
    params, losses = {}, {}
    for distributed in (False, True):
        trainer = make_trainer(out_dir, layout, distributed_optimizer=distributed)
        losses[distributed] = [train_step(trainer, s) for s in range(steps)]
        params[distributed] = local_params(trainer)
        kind = type(trainer.optimizer.chained_optimizers[0]).__name__
        del trainer
        gc.collect()
    moved = _max_diff(params[False], {k: torch.zeros_like(v) for k, v in params[False].items()})
    return {"param_maxdiff": _max_diff(params[False], params[True]), "param_maxabs": moved,
            "losses_plain": losses[False], "losses_distributed": losses[True], "distributed_kind": kind}


def bad_checkpoints(out_dir: str, intact: Path) -> dict:
    """Resumes from damaged copies of an intact EP2 checkpoint (step 1 of the killed run): a newest checkpoint with a
    shard file missing, in front of the intact one; and the intact one under another model (2 layers, not 4) with
    nothing older. Records where each resumed, or the error it stopped with."""
    import shutil

    damaged, other = Path(out_dir, "damaged", "checkpoints"), Path(out_dir, "other_model", "checkpoints")
    if dist.get_rank() == 0:
        shutil.copytree(intact, damaged / "step_1")
        shutil.copytree(intact, damaged / "step_2")
        state = json.loads((damaged / "step_2" / "trainer_state.json").read_text())
        (damaged / "step_2" / "trainer_state.json").write_text(json.dumps({**state, "step": 2}))
        (damaged / "step_2" / "__1_0.distcp").unlink()  # rank 1's shard file
        (damaged / "latest").write_text("step_2")
        shutil.copytree(intact, other / "step_1")
        (other / "latest").write_text("step_1")
    dist.barrier()
    results = {}
    for name, root, extra in (("damaged", damaged, []), ("other_model", other, ["model.preset=tiny-2layer"])):
        trainer = make_trainer(str(root.parent), "ep2", distributed_optimizer=False, extra=extra)
        try:
            start = resume(trainer)
            results[name] = {"start": start, "loss": train_step(trainer, start)}
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        del trainer
        gc.collect()
    return results


def _shard_files(checkpoint: Path) -> list[int]:
    """The bytes of each rank's shard file (__<rank>_0.distcp) in a committed checkpoint."""
    return [Path(checkpoint, f"__{r}_0.distcp").stat().st_size for r in range(dist.get_world_size())]


def dp_reshardable(out_dir: str, save_at: int, more: int) -> dict:
    """At DP2 with the distributed optimizer: a routine save (dp_reshardable, the default) at step `save_at`, then
    `more` reference steps; its resume at DP2 (the next losses, bit for bit) and at EP2 (the one-line refusal); an
    export save (the run's last, schedule.steps=save_at) of the same steps, resumed at EP2. Records each checkpoint's
    shard file sizes, its optimizer_formats and the model's parameter count (each rank holds the whole model at DP2)."""
    routine, export = Path(out_dir, "dp_routine"), Path(out_dir, "dp_export")
    results: dict = {}
    trainer = make_trainer(str(routine), "dp2", distributed_optimizer=True)
    results["params"] = sum(p.numel() for p in trainer.gpt.parameters())
    for step in range(save_at):
        train_step(trainer, step)
    save(trainer, save_at)
    results["reference"] = [train_step(trainer, s) for s in range(save_at, save_at + more)]
    step_dir = routine / "checkpoints" / f"step_{save_at}"
    results["routine"] = {"files": _shard_files(step_dir),
                          "formats": json.loads((step_dir / "trainer_state.json").read_text())["optimizer_formats"]}
    del trainer
    gc.collect()
    trainer = make_trainer(str(routine), "dp2", distributed_optimizer=True)
    start = resume(trainer)
    results["resumed_same"] = {"start": start, "losses": [train_step(trainer, s) for s in range(start, start + more)]}
    del trainer
    gc.collect()
    trainer = make_trainer(str(routine), "ep2", distributed_optimizer=True)
    try:
        results["resumed_other"] = {"start": resume(trainer)}
    except Exception as exc:  # noqa: BLE001 - the test reads it
        results["resumed_other"] = {"error": f"{type(exc).__name__}: {exc}"}
    del trainer
    gc.collect()
    trainer = make_trainer(str(export), "dp2", distributed_optimizer=True, extra=[f"schedule.steps={save_at}"])
    for step in range(save_at):
        train_step(trainer, step)
    save(trainer, save_at)
    step_dir = export / "checkpoints" / f"step_{save_at}"
    results["export"] = {"files": _shard_files(step_dir),
                         "formats": json.loads((step_dir / "trainer_state.json").read_text())["optimizer_formats"]}
    del trainer
    gc.collect()
    trainer = make_trainer(str(export), "ep2", distributed_optimizer=True, extra=[f"schedule.steps={save_at + more}"])
    start = resume(trainer)
    results["export_resumed_ep2"] = {"start": start,
                                     "losses": [train_step(trainer, s) for s in range(start, start + more)]}
    del trainer
    gc.collect()
    return results


def _write(out_dir: str, name: str, results: dict) -> None:
    if dist.get_rank() == 0:
        Path(out_dir, name).write_text(json.dumps(results))
    dist.barrier()


def four_ranks(out_dir: str, ckpt_dir: str, save_at: int, more: int) -> None:
    """At TP2xEP2: the distributed-vs-plain check; then the reference run: `save_at` steps, an async checkpoint,
    `more` steps (their losses are what the resharded resumes must reproduce)."""
    results = {"distributed_vs_plain": distributed_vs_plain(out_dir, "tp2ep2")}
    # An async save (megatron's background writer): training goes on while it writes, so the resumes below also show
    # that the checkpoint holds the state at save time, not what the next steps made of it.
    # The format that reshards across TP/PP/EP (routine saves default to dp_reshardable, pinned to their layout).
    trainer = make_trainer(ckpt_dir, "tp2ep2", distributed_optimizer=True,
                           extra=["logging.checkpoint_async=true", "logging.checkpoint_format=fully_reshardable"])
    for step in range(save_at):
        train_step(trainer, step)
    save(trainer, save_at)
    results["latest_while_saving"] = str(trainer.checkpoints.latest())
    results["reference_losses"] = [train_step(trainer, s) for s in range(save_at, save_at + more)]
    trainer.checkpoints.wait()
    _write(out_dir, "four_ranks.json", results)
    dist.destroy_process_group()


def two_ranks(out_dir: str, ckpt_dir: str, more: int, killed_dir: str) -> None:
    """At 2 ranks: the distributed-vs-plain check at DP2 and EP2; resumes of the TP2xEP2 checkpoint at EP2, PP2 and
    DP2 (`more` steps each); the resume of the run killed mid-save (its previous checkpoint, same layout)."""
    results: dict = {f"distributed_vs_plain_{layout}": distributed_vs_plain(out_dir, layout) for layout in ("dp2", "ep2")}
    for layout in ("ep2", "pp2", "dp2"):
        trainer = make_trainer(ckpt_dir, layout, distributed_optimizer=True)
        start = resume(trainer)
        results[f"resumed_{layout}"] = {"start": start,
                                        "losses": [train_step(trainer, s) for s in range(start, start + more)],
                                        "optimizer": type(trainer.optimizer.chained_optimizers[0]).__name__}
        del trainer
        gc.collect()
    trainer = make_trainer(killed_dir, "ep2", distributed_optimizer=False)
    latest = trainer.checkpoints.latest()
    start = resume(trainer)
    results["resumed_after_kill"] = {"latest": str(latest), "start": start, "loss": train_step(trainer, start)}
    del trainer
    gc.collect()
    results.update(bad_checkpoints(out_dir, Path(killed_dir, "checkpoints", "step_1")))
    results["dp_reshardable"] = dp_reshardable(out_dir, 2, more)
    _write(out_dir, "two_ranks.json", results)
    dist.destroy_process_group()


def context_parallel_resume(out_dir: str, ckpt_dir: str, save_at: int, more: int) -> None:
    """CP2 (the distributed optimizer sharded over DP x CP): `save_at` steps, a fully_reshardable save, `more` steps
    (the reference); then the checkpoint resumed at DP2 (CP1) for `more` steps."""
    trainer = make_trainer(ckpt_dir, "cp2", distributed_optimizer=True,
                           extra=["logging.checkpoint_format=fully_reshardable"])
    for step in range(save_at):
        train_step(trainer, step)
    save(trainer, save_at)
    trainer.checkpoints.wait()
    results = {"reference": [train_step(trainer, s) for s in range(save_at, save_at + more)]}
    del trainer
    gc.collect()
    trainer = make_trainer(ckpt_dir, "dp2", distributed_optimizer=True)
    start = resume(trainer)
    results["resumed"] = {"start": start, "losses": [train_step(trainer, s) for s in range(start, start + more)]}
    _write(out_dir, "context_parallel.json", results)
    dist.destroy_process_group()


def killed_in_save(out_dir: str) -> None:
    """Step 0, checkpoint 1, step 1 (its loss recorded), then checkpoint 2, inside which one rank stalls (the test sets
    mpo.trainer.dist_checkpoint.STALL_ENV) until the test kills it with SIGKILL."""
    trainer = make_trainer(out_dir, "ep2", distributed_optimizer=False)
    train_step(trainer, 0)
    save(trainer, 1)
    loss = train_step(trainer, 1)
    if dist.get_rank() == 0:
        Path(out_dir, "step1_loss.json").write_text(json.dumps({"loss": loss}))
    save(trainer, 2)
    dist.destroy_process_group()


if __name__ == "__main__":  # the killed job runs as its own process tree: python -m helpers.state_worker <out_dir>
    import sys

    from helpers.spawn import spawn_ranks

    spawn_ranks(2, killed_in_save, sys.argv[1])
