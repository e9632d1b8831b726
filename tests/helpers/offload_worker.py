"""Per-rank body of the trainer-offload tests (tests/test_offload.py), in one spawn (this box's CPU is the budget):

* round trips: the real Trainer (megatron model, DDP, optimizer) trained with teacher-forced steps
  (helpers.state_worker), offloaded and reloaded between steps, against an un-offloaded twin from the same seed;
* the loop: mpo.trainer.loop.run from the same seed without and with rollout.colocate (the engine releases and
  resumes its memory, the trainer offloads and reloads around every batch), against one mpo engine that rank 0
  starts at the beginning, so its start-up overlaps the round trips. Every run pushes its weights to the engine
  before its first batch, so the second run does not see the first's.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.state_worker import local_params, make_trainer, train_step

# The fp32 main params and shards megatron's optimizer wrappers keep (the ones that exist on a given wrapper).
WRAPPER_GROUPS = ("fp32_from_float16_groups", "float16_groups", "fp32_from_fp32_groups",
                  "shard_fp32_from_float16_groups", "shard_fp32_groups", "shard_float16_groups",
                  "model_float16_groups", "model_fp32_groups")


def held_tensors(trainer) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every tensor this rank's run holds, by name, walked from megatron's own structures (not by TrainerOffload),
    and the names of the gradient buffers among them."""
    from mpo.models.chunks import as_chunks

    held: dict[str, torch.Tensor] = {}
    grads: set[str] = set()
    parts = [("policy", trainer.model, trainer.optimizer)]
    if trainer.critic is not None:
        parts.append(("critic", trainer.critic.model, trainer.critic.optimizer))
    for name, model, optimizer in parts:
        for c, ddp in enumerate(as_chunks(model)):
            held.update({f"{name}.{c}.{n}": p for n, p in ddp.module.named_parameters()})
            held.update({f"{name}.{c}.buffer.{n}": b for n, b in ddp.module.named_buffers()})
            for i, buffer in enumerate(ddp.buffers + ddp.expert_parallel_buffers):
                if buffer.param_data is not None:
                    held[f"{name}.{c}.param_data{i}"] = buffer.param_data
                held[f"{name}.{c}.grad_data{i}"] = buffer.grad_data
                grads.add(f"{name}.{c}.grad_data{i}")
        for m, member in enumerate(optimizer.chained_optimizers):
            for g, group in enumerate(member.optimizer.param_groups):
                held.update({f"{name}.opt{m}.group{g}.{j}": p for j, p in enumerate(group["params"])})
            for j, state in enumerate(member.optimizer.state.values()):
                held.update({f"{name}.opt{m}.state{j}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
            for attr in WRAPPER_GROUPS:
                for g, group in enumerate(getattr(member, attr, None) or []):
                    held.update({f"{name}.opt{m}.{attr}{g}.{j}": t for j, t in enumerate(group) if torch.is_tensor(t)})
    held.update({f"reference.{k}": v for k, v in (trainer.reference or {}).items()})
    return held, grads


def _storage_bytes(tensors) -> int:
    """Device bytes behind `tensors`: each distinct storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _numel_by_size(trainer) -> dict[int, int]:
    """This rank's policy parameter count per element size (bytes)."""
    counts: dict[int, int] = {}
    for p in trainer.gpt.parameters():
        counts[p.element_size()] = counts.get(p.element_size(), 0) + p.numel()
    return counts


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _variant(out_dir: str, distributed_optimizer: bool, extra: list[str]) -> dict:
    """Step 0, two offload/reload cycles (checked), step 1; the same two steps on a twin that never offloads."""
    overrides = ["rollout.colocate=true", *extra]
    trainer = make_trainer(out_dir, "ep2", distributed_optimizer=distributed_optimizer, extra=overrides)
    losses = [train_step(trainer, 0)]  # Adam's state exists from here
    held, grads = held_tensors(trainer)
    snapshot = {k: _bits(v) for k, v in held.items() if k not in grads}
    expected = _storage_bytes(held.values())
    offload = trainer._trainer_offload()
    result: dict = {"expected_bytes": expected, "held": len(held),
                    "optimizers": sorted({type(m).__name__ for m in trainer.optimizer.chained_optimizers}),
                    "numel_by_size": _numel_by_size(trainer),
                    "param_tensors": sum(1 for _ in trainer.gpt.parameters()),
                    "state_keys": sorted({k for m in trainer.optimizer.chained_optimizers
                                          for s in m.optimizer.state.values() for k in s})}
    cycles = []
    for _ in range(2):
        offload.offload()
        still = [k for k, v in held.items() if v.untyped_storage().size() != 0]
        try:
            offload.offload()
            twice = None
        except RuntimeError as exc:
            twice = str(exc)
        offload.reload()
        differ = [k for k, v in snapshot.items() if not torch.equal(_bits(held[k]), v)]
        nonzero_grads = [k for k in grads if held[k].count_nonzero().item() != 0]
        cycles.append({"metrics": offload.metrics(), "resident_while_offloaded": still, "offload_twice": twice,
                       "differ_after_reload": differ, "nonzero_grads_after_reload": nonzero_grads})
    try:
        offload.reload()
        result["reload_twice"] = None
    except RuntimeError as exc:
        result["reload_twice"] = str(exc)
    result["cycles"] = cycles
    result["by_kind"] = offload.bytes_by_kind()
    result["has_critic"] = trainer.critic is not None
    result["has_reference"] = trainer.reference is not None
    losses.append(train_step(trainer, 1))
    params = local_params(trainer)
    del trainer, offload, held, snapshot
    gc.collect()

    twin = make_trainer(out_dir, "ep2", distributed_optimizer=distributed_optimizer, extra=overrides)
    twin_losses = [train_step(twin, 0), train_step(twin, 1)]
    twin_params = local_params(twin)
    differ = [k for k in params if not torch.equal(_bits(params[k]), _bits(twin_params[k]))]
    flag = torch.tensor([float(len(differ))])
    dist.all_reduce(flag)
    result.update(losses=losses, twin_losses=twin_losses, params_differ_from_twin=int(flag))
    del twin
    gc.collect()
    return result


def _loop_runs(out_dir: str, url: str, steps: int, overrides: list[str]) -> None:
    """The demo loop twice; each run writes <out_dir>/colocate_<false|true>/metrics.jsonl."""
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.trainer.loop import run as run_loop

    for colocate in ("false", "true"):
        config = load_config(RECIPES / "demo_cpu.yaml", [
            f"logging.out_dir={out_dir}/colocate_{colocate}", "world_size=2", "parallel.expert_parallel=2",
            f"rollout.colocate={colocate}", f"rollout.urls=[{url}]",
            f"schedule.steps={steps}", "logging.tensorboard=false", "logging.progress=false", *overrides])
        run_loop(config)


def run(out_dir: str, variants: dict[str, tuple[bool, list[str]]], loop_steps: int, loop_overrides: list[str]) -> None:
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.rollout.engine_command import EngineSettings
    from mpo.rollout.local_engine import LocalEngineProcess

    engine, started = None, None
    # Rank 0 starts the loop's engine (memory saver on, as the colocated run needs; the resident run never releases).
    # No process group yet (the first Trainer makes it): the rank comes from torchrun's environment.
    if os.environ["RANK"] == "0":
        config = load_config(RECIPES / "demo_cpu.yaml", ["rollout.colocate=true"])
        settings = EngineSettings.from_config(config.model, config.rollout, config.sync, seed=config.seed)
        engine = LocalEngineProcess.mpo_engine(log_path=Path(out_dir, "engine.log"), settings=settings)
        failed: list[BaseException] = []

        def start() -> None:
            try:
                engine.start()
            except BaseException as exc:  # noqa: BLE001 - raised on this rank's main thread below
                failed.append(exc)

        started = threading.Thread(target=start, daemon=True)
        started.start()
    try:
        results = {name: _variant(out_dir, distributed, extra) for name, (distributed, extra) in variants.items()}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        if dist.get_rank() == 0:
            Path(out_dir, "offload.json").write_text(json.dumps(gathered))
            started.join()
            if failed:
                raise failed[0]
        url = engine.url if engine is not None else None
        dist.broadcast_object_list(box := [url], src=0)
        _loop_runs(out_dir, box[0], loop_steps, loop_overrides)
    finally:
        if engine is not None:
            engine.stop()
    dist.destroy_process_group()
