"""Per-rank body of the streaming weight-sync tests: the real Trainer at a 4-rank layout (gloo) and a real local mpo
engine over HTTP; `_sync` runs with `gather_full_state` made to raise, so any full-model gather in the sync path
fails the run."""

from __future__ import annotations

import json
import os
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


def perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Add noise that is a pure function of (key, global offset) to every shard, so DP replicas stay equal and the
    trainer's weights differ from the engine's initial ones (same seed) everywhere."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    with torch.no_grad():
        for item in nested_values(sharded):
            if isinstance(item, ShardedTensor):
                seed = zlib.crc32(f"{item.key}{tuple(item.global_offset)}".encode())
                noise = torch.randn(item.data.shape, generator=torch.Generator().manual_seed(seed))
                item.data.add_(scale * noise.to(item.data.dtype))


@contextmanager
def forbid_full_gather():
    """gather_full_state raises inside the block (the weight sync and step loop must not gather the full model)."""
    import mpo.models.full_state as full_state

    original = full_state.gather_full_state

    def forbidden(*args, **kwargs):
        raise AssertionError("gather_full_state called in the step loop / weight sync")

    full_state.gather_full_state = forbidden
    try:
        yield
    finally:
        full_state.gather_full_state = original


def trainer_shared(weights) -> bool:
    return weights.streamer.shared


def streaming(out_dir: str, layout: list[str], transports: list[str], restart_race: bool = False) -> None:
    """For each transport: perturb the weights, sync (no full gather allowed), then compare the engine's checksum
    with one computed from an independent full gather of the trainer (test-only), and record the sync metrics.
    restart_race: then sync_while_the_pool_restarts with the first transport's engine."""
    from mpo.models.hf_mapping import mapping_for
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.models.full_state import gather_full_state
    from mpo.weight_sync.verify import weights_checksum
    from mpo.trainer.loop import engine_set
    from mpo.trainer.loop import publisher
    from mpo.trainer.trainer import Trainer

    import mpo.weight_sync.gather  # noqa: F401  (the tree under test: its path is recorded below)

    results: dict = {"mpo_path": mpo.weight_sync.gather.__file__}
    owner = None  # the EngineSet that started the one local engine; later transports reach it by URL
    owner_config = None
    trainer = None
    for item in transports:  # "TRANSPORT" or "TRANSPORT/gloo" (pieces over gloo, not shared memory)
        transport, _, gather = item.partition("/")
        urls = [f"rollout.urls=[{owner.clients[0].url}]", f"rollout.api_key={owner.api_key}"] if owner is not None \
            else []  # the run's engine has the key its EngineSet made
        config = load_config(RECIPES / "demo_cpu.yaml", [
            f"logging.out_dir={out_dir}/{transport}", "world_size=4", "parallel.expert_parallel=1", *layout,
            f"sync.transport={transport}", "sync.bucket_mb=1", "schedule.sft_steps=0", *urls,
            f"sync.host_shared_memory={'false' if gather == 'gloo' else 'true'}"])
        trainer = trainer or Trainer(config)
        trainer.config = config
        engines = engine_set(config, Path(out_dir, transport)) if dist.get_rank() == 0 else None
        weights = publisher(trainer, engines)
        owner_config = owner_config or config
        owner = owner or engines
        try:
            before = engines.clients[0].call("/weights_checksum", method="GET")["checksum"] if engines else None
            perturb(trainer.gpt)
            with forbid_full_gather():
                metrics = weights.publish(1)  # verifies the engine checksum itself
            full = gather_full_state(trainer.gpt)
            if engines is not None:
                named = mapping_for(trainer.model_cfg, spec="local").full_state_to_hf(full)
                expected = weights_checksum(named)
                got = engines.clients[0].call("/weights_checksum", method="GET")["checksum"]
                leftover = sorted(p.name for p in Path("/dev/shm").glob(f"mpo-sync-*-p{os.getpid()}-*-r*"))
                results[item] = {"metrics": metrics, "engine_matches_full_gather": got == expected,
                                 "engine_changed": got != before, "shared": trainer_shared(weights),
                                 "leftover_shm_files": leftover}
        finally:
            weights.close()
            if engines is not None and engines is not owner:
                engines.stop()  # the engine itself belongs to the owner
        dist.barrier()
    if restart_race:
        trainer.config = owner_config
        began = time.perf_counter()
        results["restart_race"] = sync_while_the_pool_restarts(trainer, owner)
        results["death_race"] = sync_while_the_engine_dies(trainer, owner)
        results["restart_race_s"] = time.perf_counter() - began
    if owner is not None:
        owner.stop()  # the publishers closed their sessions (shm: the spill buffer) above
    if dist.get_rank() == 0:
        results["leftover_after_stop"] = sorted(p.name for p in Path("/dev/shm").glob(f"mpo-sync-*-p{os.getpid()}-*"))
        Path(out_dir, "sync.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def sync_while_the_pool_restarts(trainer, engines) -> dict | None:
    """Async mode's race (issue #24): the engine is killed, the rollout producer's pool restarts it on its thread
    (the handle's restart, as RolloutPool._recover calls it), and the trainer's weight sync starts meanwhile. Before
    the fix the sync paused the engine while it was down (EngineError: ConnectError on /pause_generation) and the run
    died. Records, on rank 0: whether the engine is a new process and holds exactly the weights just synced."""
    import threading

    from mpo.models.hf_mapping import mapping_for
    from mpo.models.full_state import gather_full_state
    from mpo.weight_sync.verify import weights_checksum
    from mpo.trainer.loop import publisher

    restarting, old_pid = None, None
    if engines is not None:
        process = engines.processes[0]
        old_pid = process.process.pid
        process.kill()
        restarting = threading.Thread(target=engines.handles[0][1], name="pool-restart", daemon=True)
        restarting.start()
    perturb(trainer.gpt, scale=0.01)
    weights = publisher(trainer, engines)
    try:
        weights.publish(2)
    finally:
        weights.close()
    full = gather_full_state(trainer.gpt)
    if engines is None:
        return None
    restarting.join(120)
    expected = weights_checksum(mapping_for(trainer.model_cfg, spec="local").full_state_to_hf(full))
    got = engines.clients[0].call("/weights_checksum", method="GET")["checksum"]
    return {"restarted": engines.processes[0].process.pid != old_pid and not restarting.is_alive(),
            "engine_matches_full_gather": got == expected}


def sync_while_the_engine_dies(trainer, engines) -> dict | None:
    """The other half of the race (issue #24): the engine dies inside the weight update (killed as the first bucket
    is pushed), while the pool's thread, having seen it fail, restarts it. Before the fix the push failed
    (ConnectError) and the run died. Records, on rank 0: whether the engine came back as a new process holding
    exactly the weights of the update it missed (the publish streams once more for it), and no longer stale."""
    import threading

    from mpo.models.hf_mapping import mapping_for
    from mpo.models.full_state import gather_full_state
    from mpo.weight_sync.verify import weights_checksum
    from mpo.trainer.loop import publisher

    threads, old_pid = [], None
    weights = publisher(trainer, engines)
    if engines is not None:
        sync = weights.engine_session()  # the publisher's own session, the one its stream pushes through
        process, push_bucket = engines.processes[0], sync.push_bucket
        old_pid = process.process.pid

        def dying_push(*args, **kwargs):
            if not threads:
                process.kill()
                threads.append(threading.Thread(target=engines.handles[0][1], name="pool-restart", daemon=True))
                threads[0].start()
            return push_bucket(*args, **kwargs)

        sync.push_bucket = dying_push
    perturb(trainer.gpt, scale=0.01)
    try:
        weights.publish(3)
    finally:
        if engines is not None:
            sync.push_bucket = push_bucket
        weights.close()
    full = gather_full_state(trainer.gpt)
    if engines is None:
        return None
    threads[0].join(120)
    expected = weights_checksum(mapping_for(trainer.model_cfg, spec="local").full_state_to_hf(full))
    got = engines.clients[0].call("/weights_checksum", method="GET")["checksum"]
    return {"restarted": engines.processes[0].process.pid != old_pid and not threads[0].is_alive(),
            "engine_matches_full_gather": got == expected, "stale": sorted(engines.stale)}


def sglang_streaming(out_dir: str, hf_dir: str, mcore_dir: str, url: str, tp_size: int, layout: list[str],
                     transports: list[str]) -> None:
    """A 4-rank trainer (the converted checkpoint of the HF model the SGLang server serves, at `layout`) perturbs its
    weights, checks that the server's covering probe now disagrees (the check is not vacuous), then runs the loop's
    publisher (stream + covering-probe verification, no full gather allowed) over each transport."""
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.rollout.client import EngineError
    from mpo.trainer.loop import engine_set
    from mpo.trainer.loop import publisher
    from mpo.trainer.trainer import Trainer

    results: dict = {}
    trainer = None
    for i, transport in enumerate(transports):
        config = load_config(RECIPES / "demo_cpu.yaml", [
            f"logging.out_dir={out_dir}/{transport}", "world_size=4", "parallel.expert_parallel=1", *layout,
            f"model.hf_dir={hf_dir}", f"model.mcore_dir={mcore_dir}", "model.fp32_lm_head=false",
            "rollout.engine=sglang", f"rollout.urls=[{url}]", f"rollout.tensor_parallel={tp_size}",
            f"sync.transport={transport}", "sync.bucket_mb=1", "schedule.sft_steps=0"])
        trainer = trainer or Trainer(config)
        trainer.config = config
        engines = engine_set(config, Path(out_dir, transport)) if dist.get_rank() == 0 else None
        weights = publisher(trainer, engines)
        try:
            perturb(trainer.gpt, scale=0.05 * (i + 1))
            stale = None
            try:
                weights.verify_by_probe()
            except EngineError as exc:
                stale = str(exc)
            with forbid_full_gather():
                metrics = weights.publish(i)  # raises if the probe disagrees
            if engines is not None:
                results[transport] = {"metrics": metrics, "stale_error": stale,
                                      "tp_sizes": weights.engine_session().tp_sizes}
        finally:
            weights.close()  # its weight-update group, before the engines stop
            if engines is not None:
                engines.stop()
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out_dir, "sglang_sync.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
