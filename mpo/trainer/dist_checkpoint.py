"""Reshardable trainer checkpoints: megatron `dist_checkpointing` (torch_dist) of the models, their optimizers' sharded
state, every rank's RNG, and the loop's own JSON state.

Layout: <out_dir>/checkpoints/step_<k>/{torch_dist files, trainer_state.json}, and <out_dir>/checkpoints/latest naming
the newest complete one; the newest `logging.keep_checkpoints` (default 2) are kept, older ones deleted once a newer
one is committed. Every checkpoint also carries the files that make it a model of its own (mpo.model_files): the HF
config (`hf_config.json`) and the tokenizer, chat template and generation config (`hf_assets/`), written with it
before it is committed, so that `mpo export`, `checkpoints_tools mcore-to-hf` / `verify` and a new run's
`model.mcore_dir` take the step directory as it is (the policy's model keys are unprefixed, as in a converted
checkpoint). Every tensor is stored as a shard of its global (model-space) tensor, so a checkpoint saved
at one parallel layout loads at another (TP, PP, EP, DP): the models through their `sharded_state_dict`, the
optimizers' Adam moments mapped onto the parameters' global tensors (see OPTIMIZER_SHARDING). Saves and loads are fully parallel:
each replicated shard is written by one data-parallel rank and read once, then exchanged.

Formats of the distributed optimizer's state (`logging.checkpoint_format`, recorded per model in trainer_state.json as
`optimizer_formats`): routine saves default to megatron's 'dp_reshardable' (each DP rank writes its own range of the
flat buffers: no gather of Adam state onto one rank; loads only at the saved layout, checked before any data is read,
one line otherwise); 'fully_reshardable' (model space, any layout) on request and for the run's last save (the
export, `save(..., export=True)`). The plain optimizer's state is per model shard, model space in either case.

Atomicity: all ranks write into step_<k>.tmp; each fsyncs what it wrote; only then rank 0 renames the directory to
step_<k> and replaces `latest` (write, fsync, rename). A process killed anywhere before leaves `latest` naming the
previous checkpoint, which stays intact. With `async_save` (default on GPU) the write runs in a background process and
the rename happens when the next save (or `wait()`) finalises it: until then `latest` names the previous checkpoint.

Loading reads only data (mpo.safe_load's reader: restricted metadata unpickler, weights-only objects). RNG states
are restored when the layout is unchanged (same-layout resumes stay bit-exact); a resharded resume keeps the
freshly seeded generators, as there is no per-rank correspondence between layouts (the loop draws its randomness
from (seed, step) anyway).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from mpo.lifecycle import NoSpaceLeft, _no_space_error, die_with_parent, writing
from mpo.model_files import TRAINER_STATE, CheckpointError, complete_checkpoints, latest_checkpoint
from mpo.models.ddp import inner_optimizers

log = logging.getLogger(__name__)

# Model-space optimizer state: reshardable over every parallel dimension. The plain optimizer's state is per model
# shard already. The DistributedOptimizer's is per DP-rank range of the flat buffers; megatron 0.19.2 offers one
# format that maps it to model space, 'fully_reshardable' ('fully_sharded_model_space' needs ShardedTensor
# flattened_range, which 0.19.2 rejects): the DP ranks' ranges are gathered over gloo to DP rank 0 in host memory
# (mem_efficient; the default NCCL all-gather would materialise a model shard's whole Adam state in GPU memory on every
# DP rank), which writes them. Without the prefix switch a ChainedOptimizer (dense + expert parameters) would key its
# state by its position in the chain, which depends on the layout.
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable",
                      "distrib_optim_fully_reshardable_mem_efficient": True, "chained_optim_avoid_prefix": True}
# Routine saves at scale: every DP rank writes the state it owns as it lies in the DistributedOptimizer's buckets (one
# ShardedTensor per bucket, keyed by the model-parallel group and bucket index: layout-specific). ChainedOptimizer keys
# it by chain position here (megatron adds the prefix for non-reshardable formats), which is fine at the same layout.
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}
FORMATS = ("dp_reshardable", "fully_reshardable")
# Test hook (tests/test_trainer_state.py): "<rank>:<step>" makes that rank stop inside the save of that step, after its
# shards are written and before the checkpoint is committed, and write its pid to <tmp dir>/stalled; the test then
# kills it with SIGKILL. Unset in real runs.
STALL_ENV = "MPO_TEST_STALL_IN_SAVE"


@dataclass
class Part:
    """One model and its optimizer in the checkpoint. `prefix` keeps the keys of different models apart (the critic
    has the policy's architecture, so the same parameter names)."""

    prefix: str
    gpt: torch.nn.Module
    optimizer: Any


def layout_of(ctx: Any) -> dict[str, int]:
    """The parallel layout a checkpoint is written at (mpo.parallel.ParallelContext)."""
    from megatron.core import parallel_state as ps

    return {"world_size": ctx.world_size, "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
            "expert_parallel": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel": ps.get_expert_tensor_parallel_world_size(),
            "context_parallel": ps.get_context_parallel_world_size()}


def rng_state() -> dict[str, Any]:
    """This rank's generators: torch's CPU one, CUDA's (on GPU) and megatron's model-parallel tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if state.get("tracker"):
        get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def is_distributed(optimizer: Any) -> bool:
    """Whether a megatron (chained) optimizer shards its state over data parallelism (DistributedOptimizer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _fresh_non_param_state(state: Any) -> Any:
    """For loading a dp_reshardable DistributedOptimizer state: its non-parameter entries (param groups: lr, betas,
    ...) are ShardedObjects in that format; keep the freshly built optimizer's values instead (never read), as the
    fully reshardable format does (see _skeleton; Adam's step comes from trainer_state.json)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

    if not isinstance(state, dict):
        return state
    if "param_state_sharding_type" not in state:  # a ChainedOptimizer's {index: optimizer state}
        return {k: _fresh_non_param_state(v) for k, v in state.items()}
    return {k: LocalNonpersistentObject(v.data) if isinstance(v, ShardedObject) and k != "param_state" else v
            for k, v in state.items()}


def sharded_state(parts: list[Part], *, is_loading: bool, rng: bool, formats: dict[str, str] | None = None,
                  models_only: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The sharded state dict of every part: its model, then its optimizer's state in `formats[prefix]`
    ('fully_reshardable': mapped onto the model's tensors; 'dp_reshardable': the DP rank's own bucket ranges); the
    parts whose prefix is in `models_only` without their optimizer (whose loading state megatron would first fill with
    zero moments)."""
    state: dict[str, Any] = {}
    for part in parts:
        model = part.gpt.sharded_state_dict(prefix=part.prefix)
        state[f"{part.prefix}model"] = model
        if part.prefix in models_only:
            continue
        fmt = (formats or {}).get(part.prefix, "fully_reshardable")
        dp = fmt == "dp_reshardable" and is_distributed(part.optimizer)
        optimizer = part.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                      metadata=DP_RESHARDABLE if dp else OPTIMIZER_SHARDING)
        state[f"{part.prefix}optimizer"] = _fresh_non_param_state(optimizer) if dp and is_loading else optimizer
    if rng:
        from megatron.core.dist_checkpointing import ShardedObject

        data = rng_state() if not is_loading else None
        state["rng"] = ShardedObject("rng", data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)
    return state


def _strategies(checkpoint_dir: Path | None):
    """Fully parallel save/load over the data-parallel group: each replicated shard is written (read) by one rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    group = ps.get_data_parallel_group(with_context_parallel=True)
    if checkpoint_dir is None:
        return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(checkpoint_dir)), group)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _maybe_stall(step: int, tmp: Path) -> None:
    spec = os.environ.get(STALL_ENV)
    if not spec:
        return
    rank, at = (int(x) for x in spec.split(":"))
    if rank == dist.get_rank() and at == step:
        (tmp / "stalled").write_text(str(os.getpid()))
        while True:  # until the test's SIGKILL
            time.sleep(1)


class DistCheckpointer:
    """Collective save/load of trainer checkpoints; see the module docstring."""

    def __init__(self, out_dir: str | Path, *, keep: int = 2, async_save: bool = False,
                 format: str = "dp_reshardable", model_files: Callable[[Path], None] | None = None) -> None:
        """`keep`: complete checkpoints kept (>= 1); `model_files(directory)`: writes the HF config and tokenizer files
        into a checkpoint before it is committed (rank 0; mpo.model_files.copy_model_files)."""
        if keep < 1:
            raise ValueError(f"logging.keep_checkpoints={keep}; valid values: >= 1")
        if format not in FORMATS:
            raise ValueError(f"logging.checkpoint_format={format!r}; valid values: {', '.join(FORMATS)}")
        self.format = format  # routine saves' format; export saves are fully_reshardable
        self._need_bytes = 0  # the last save's estimated shard size (full-disk diagnosis)
        self.root = Path(out_dir) / "checkpoints"
        self.keep = keep
        self.model_files = model_files
        self.async_save = async_save
        self._queue = None  # megatron AsyncCallsQueue, made on the first async save
        self._pending = self.root  # the file an async save in flight names if the disk fills

    # -- pointer ---------------------------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The checkpoint to resume from (mpo.model_files.latest_checkpoint)."""
        return latest_checkpoint(self.root)

    def resume_point(self, parts: list[Part], group: Any = None) -> Path | None:
        """Collective: the checkpoint to resume from (None for a run that never completed one). `latest()`, checked
        before any read (problem()); where it cannot be loaded into these parts (a missing or damaged shard file,
        another model's checkpoint) the newest older complete checkpoint that can, saying what was wrong in one
        line, and a CheckpointError (one line) when there is none: never a silent restart from step 0."""
        path = self.latest()
        if path is None:
            return None
        older = [p for p in reversed(complete_checkpoints(self.root)) if int(p.name[5:]) < int(path.name[5:])]
        first = None
        for candidate in (path, *older):
            problem = self.problem(candidate, parts, group)
            if problem is None:
                if first is not None and dist.get_rank() == 0:
                    log.warning("%s; resuming from the previous intact checkpoint, %s", first, candidate.name)
                return candidate
            first = first or f"checkpoint {path} cannot be resumed: {problem}"
        raise CheckpointError(f"{first}, and no older checkpoint in {self.root} is intact")

    def problem(self, path: Path, parts: list[Part], group: Any = None) -> str | None:
        """Collective: why `path` cannot be loaded into `parts`, the same answer on every rank (the first rank's
        problem), or None. Reads only metadata: the trainer state, `.metadata` with its storage entries (mpo.
        safe_load: every shard file present, a regular file inside the checkpoint, long enough), and each of this
        rank's model tensors against the saved global shapes (another model's checkpoint). Agreed before any rank
        reads data, so that all of them fall back together and the models stay untouched. `group`: every rank's
        (the trainer's gloo object group: no device tensors for a few strings); None: the default group."""
        mine = _problem(path, parts)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=group)
        return next((p for p in every if p), None)

    # -- save ------------------------------------------------------------------------------------------------------
    def save(self, step: int, parts: list[Part], trainer_state: dict[str, Any], *, wait: bool = False,
             export: bool = False) -> Path:
        """Collective. Writes step_<step>; `trainer_state` (JSON-able, rank 0's) goes next to the shards. An async save
        returns once the tensors are staged; `wait=True` (or the next save) finishes it. The optimizer state goes in
        `self.format`, or fully_reshardable with `export=True` (a checkpoint to load at any layout)."""
        from megatron.core import dist_checkpointing

        self.wait()  # one save in flight at a time: the previous one commits first
        _writer_results_queue(self.async_save)  # before step_<k>.tmp exists: a failure to start it leaves nothing
        rank = dist.get_rank()
        final, tmp = self.root / f"step_{step}", self.root / f"step_{step}.tmp"
        if rank == 0:
            for stale in self.root.glob("step_*.tmp"):  # partial saves of a crashed run: free the space
                shutil.rmtree(stale, ignore_errors=True)
            with writing(tmp):
                tmp.mkdir(parents=True)
        dist.barrier()
        requested = "fully_reshardable" if export else self.format
        # the plain optimizer's state is in model space already ('fully_reshardable')
        formats = {p.prefix: requested if is_distributed(p.optimizer) else "fully_reshardable" for p in parts}
        state = sharded_state(parts, is_loading=False, rng=True, formats=formats)
        self._need_bytes = _shard_bytes(parts)
        with self._no_space(tmp / f"__{rank}_0.distcp"):  # the shard file this rank writes
            request = dist_checkpointing.save(state, str(tmp), sharded_strategy=_strategies(None),
                                              async_sharded_save=self.async_save,
                                              async_strategy="mcore")  # megatron's own queue (no NVRx here)
        trainer_state = {**trainer_state, "optimizer_steps": {p.prefix: optimizer_step(p.optimizer) for p in parts},
                         "optimizer_formats": formats}
        text = json.dumps(trainer_state, indent=1)  # fails here, before anything is committed, if not JSON-able

        def commit() -> None:
            self._commit(step, tmp, final, text)

        if request is None:
            commit()
        else:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            request.add_finalize_fn(commit)
            self._queue = self._queue or AsyncCallsQueue()
            self._queue.schedule_async_request(request)
            self._pending = tmp / f"__{rank}_0.distcp"
            if wait:
                self.wait()
        return final

    def wait(self) -> None:
        """Collective: finish (write, commit) an async save in flight, if any."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            with self._no_space(self._pending):
                self._queue.maybe_finalize_async_calls(blocking=True)

    def _commit(self, step: int, tmp: Path, final: Path, trainer_state: str) -> None:
        """Every rank's shards are on disk (dist_checkpointing ends with a barrier): fsync, rename, move `latest`."""
        rank = dist.get_rank()
        for file in tmp.glob(f"__{rank}_*"):  # the shard files this rank wrote
            _fsync(file)
        _maybe_stall(step, tmp)
        if rank == 0:
            if self.model_files is not None:  # before the trainer state: a committed checkpoint always has them
                self.model_files(tmp)
            state_file = tmp / TRAINER_STATE
            with writing(state_file), open(state_file, "w") as f:
                f.write(trainer_state)
                f.flush()
                os.fsync(f.fileno())
            for file in tmp.rglob("*"):  # metadata and model files (rank 0 writes them)
                if file.is_file() and not file.name.startswith("__"):
                    _fsync(file)
            _fsync(tmp)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync(self.root)
            pointer_tmp = self.root / "latest.tmp"
            with writing(pointer_tmp), open(pointer_tmp, "w") as f:
                f.write(final.name)
                f.flush()
                os.fsync(f.fileno())
            os.replace(pointer_tmp, self.root / "latest")
            _fsync(self.root)
            self._prune(keep_name=final.name)
        dist.barrier()

    @contextlib.contextmanager
    def _no_space(self, where: Path):
        """A full disk inside torch_dist's writers arrives wrapped (CheckpointException, per-rank failures): NoSpaceLeft
        naming the checkpoint file, as every other write of the run reports it."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with writing(where):
                yield
        except NoSpaceLeft:
            raise
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            causes = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]
            if any(_no_space_error(c) for c in causes) or _disk_full(where, self._need_bytes):
                raise NoSpaceLeft(where) from exc
            raise

    def _prune(self, keep_name: str) -> None:
        steps = sorted((p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                       key=lambda p: int(p.name.split("_")[1]))
        for old in steps[: -self.keep]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    # -- load ------------------------------------------------------------------------------------------------------
    def load(self, path: Path, parts: list[Part], layout: dict[str, int]) -> dict[str, Any]:
        """Collective: load `path` into the parts (at this rank's layout, whatever the saved one) and, if the layout is
        the saved one, the RNG; returns the trainer state."""
        from mpo.safe_load import CheckpointFileError, load_sharded

        trainer_state = json.loads((path / TRAINER_STATE).read_text())
        same_layout = trainer_state.get("layout") == layout
        # checkpoints from before optimizer_formats were all fully_reshardable
        formats = trainer_state.get("optimizer_formats") or {p.prefix: "fully_reshardable" for p in parts}
        pinned = [p for p in parts if formats.get(p.prefix) == "dp_reshardable"]
        if pinned and (not same_layout or not all(is_distributed(p.optimizer) for p in pinned)):
            here = _show_layout(layout) + ("" if all(is_distributed(p.optimizer) for p in pinned)
                                           else " with the plain optimizer")
            raise CheckpointError(
                f"checkpoint {path} holds the {'/'.join(p.prefix or 'policy' for p in pinned)} distributed optimizer "
                f"state in the dp_reshardable format, which loads only at the layout it was saved at (distributed "
                f"optimizer, {_show_layout(trainer_state.get('layout'))}), not at {here}: resume at that layout, or "
                "from a checkpoint saved with logging.checkpoint_format=fully_reshardable (the run's last checkpoint "
                "always is)")
        steps = trainer_state.get("optimizer_steps", {})
        # An optimizer that had not stepped when saved (e.g. every group of the first steps had zero reward variance)
        # saved no state (Adam creates it at its first step): the fresh optimizer here is exactly it.
        unstepped = frozenset(p.prefix for p in parts if steps.get(p.prefix) == 0)
        state = sharded_state(parts, is_loading=True, rng=same_layout, formats=formats, models_only=unstepped)
        skeleton = _skeleton(state)
        loaded = _fill(skeleton, load_sharded(state, path, strategy=_strategies(path)))
        for part in parts:
            model = loaded[f"{part.prefix}model"]
            part.gpt.load_state_dict({k[len(part.prefix):]: v for k, v in model.items()})
            if part.prefix not in steps:
                raise CheckpointFileError(f"no optimizer_steps[{part.prefix!r}] (not an mpo trainer checkpoint, or "
                                          "one without this model)", path / TRAINER_STATE)
            if part.prefix in unstepped:
                continue
            # no_grad: megatron's dp_reshardable load copies into the main parameters outside of it (its fully
            # reshardable load is decorated), and an fp32 model's main parameters are views of leaves requiring grad
            with torch.no_grad():
                part.optimizer.load_state_dict(with_optimizer_step(part.optimizer, loaded[f"{part.prefix}optimizer"],
                                                                   steps[part.prefix]))
                if formats.get(part.prefix) == "dp_reshardable":
                    _set_per_parameter_step(part.optimizer, steps[part.prefix])
        if same_layout:
            set_rng_state(loaded["rng"])
        elif dist.get_rank() == 0:
            log.info("resharding checkpoint %s: saved at %s, loading at %s (RNG not restored)", path,
                     trainer_state.get("layout"), layout)
        return trainer_state


def _show_layout(layout: Any) -> str:
    if not isinstance(layout, dict):
        return repr(layout)
    short = {"world_size": "world", "tensor_parallel": "TP", "pipeline_parallel": "PP", "expert_parallel": "EP",
             "expert_tensor_parallel": "ETP", "context_parallel": "CP"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in layout.items())


def _problem(path: Path, parts: list[Part]) -> str | None:
    """This rank's answer for DistCheckpointer.problem."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from mpo.safe_load import METADATA_FILE, CheckpointFileError, read_dcp_metadata

    try:
        state = json.loads((path / TRAINER_STATE).read_bytes().decode("utf-8"))
        steps = state.get("optimizer_steps") if isinstance(state, dict) else None
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or UTF-8
        return f"unreadable {TRAINER_STATE} ({type(exc).__name__}: {str(exc)[:200]})"
    if not isinstance(steps, dict) or not isinstance(state.get("step"), int):
        return f"{TRAINER_STATE} is not an mpo trainer state (no step or optimizer_steps)"
    try:
        saved = read_dcp_metadata(path / METADATA_FILE).state_dict_metadata
    except CheckpointFileError as exc:
        return str(exc)
    for part in parts:
        if part.prefix not in steps:
            return f"it holds no optimizer state for {part.prefix or 'the policy'!r} (saved without this model)"
        sharded = part.gpt.sharded_state_dict(prefix=part.prefix)
        apply_factories(sharded)
        for item in nested_values(sharded):
            if not isinstance(item, ShardedTensor):
                continue
            meta = saved.get(item.key)
            if meta is None or not hasattr(meta, "size"):
                return f"another model's checkpoint: it has no tensor {item.key}"
            if tuple(meta.size) != tuple(item.global_shape):
                return (f"another model's checkpoint: {item.key} has shape {tuple(meta.size)} there, "
                        f"{tuple(item.global_shape)} in this model")
    return None


def _writer_results_queue(async_save: bool) -> None:
    """megatron's torch_dist writer hands its results back through `filesystem_async._results_queue`. A synchronous
    save writes from this process (its threads), so a plain queue serves. An async save writes from megatron's worker
    process, through a multiprocessing Manager (a server process) that megatron starts on first use and that nothing
    stops if the rank dies by SIGKILL or os._exit (a one-line stop): it would outlive the run. So start that Manager
    ourselves, once, with mpo.lifecycle's parent-death hook in it, and only for async saves (a spawned Manager imports
    torch, which made every run's first synchronous save ~2.5 s slower), without re-importing the rank's `__main__`
    (_main_module_hidden: a script without a main guard would run again in it)."""
    import multiprocessing as mp
    import queue
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    current = filesystem_async._results_queue
    if current is not None and (not async_save or not isinstance(current, queue.Queue)):
        return
    if not async_save:
        filesystem_async._results_queue = queue.Queue()
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    with _main_module_hidden():
        manager.start(initializer=die_with_parent)
    filesystem_async._manager = manager  # kept referenced: the Manager stops when garbage-collected
    filesystem_async._results_queue = manager.Queue()


@contextlib.contextmanager
def _main_module_hidden():
    """A spawned child re-imports the parent's `__main__` (as `__mp_main__`) before it runs anything: a user's script
    that calls Trainer.save without an `if __name__ == "__main__":` guard would run again inside the writer's Manager,
    whose start then fails. The Manager's server needs nothing from `__main__` (its initializer is mpo.lifecycle's,
    imported by name), so it is started with `__main__` looking like an interactive session's: no `__spec__`, no
    `__file__`, which multiprocessing.spawn takes as nothing to import. Restored right after."""
    import sys

    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _shard_bytes(parts: list[Part]) -> int:
    """About what one rank writes: its parameters and, per parameter, Adam's fp32 moments and master copy."""
    return sum(p.numel() * (p.element_size() + 12) for part in parts for p in part.gpt.parameters())


def _disk_full(where: Path, need_bytes: int = 0) -> bool:
    """megatron's writer workers pass their errors back as strings ("Worker failure: ..."), losing the ENOSPC: after a
    failed write, a filesystem with less room than this rank's shard (or under 1 MiB) is taken to be why."""
    for path in (where, *where.parents):
        if path.exists():
            return shutil.disk_usage(path).free < max(need_bytes, 1 << 20)
    return False


_SHARDED = object()  # a skeleton leaf: the value comes from the checkpoint


def _skeleton(state: Any) -> Any:
    """The containers of a sharded state dict, with its sharded leaves marked and its other leaves kept (by reference).

    Only the sharded leaves are read back from the checkpoint. The rest (optimizer param groups: learning rate, betas,
    parameter indices; megatron keeps them in the checkpoint's common state) depends on the layout (a ChainedOptimizer
    has one optimizer per parameter kind present, their param-index lists follow the local parameters) and, in this
    trainer, on the config only, so the freshly built optimizer's own values are used. The one piece of it that is
    run state, Adam's step count, travels in trainer_state.json (`optimizer_steps`)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedTensorFactory

    if isinstance(state, LocalNonpersistentObject):  # never stored: the local value, as megatron's load returns it
        return state.unwrap()
    if isinstance(state, dict):
        return {k: _skeleton(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_skeleton(v) for v in state]
    if isinstance(state, (ShardedBase, ShardedTensorFactory)):
        return _SHARDED
    return state


def _fill(skeleton: Any, loaded: Any) -> Any:
    """`skeleton` with its marked leaves taken from `loaded` (what dist_checkpointing.load returned)."""
    if isinstance(skeleton, dict):
        return {k: _fill(v, loaded.get(k) if isinstance(loaded, dict) else None) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        items = loaded if isinstance(loaded, list) else [None] * len(skeleton)
        return [_fill(v, x) for v, x in zip(skeleton, items)]
    return loaded if skeleton is _SHARDED else skeleton


def optimizer_step(optimizer: Any) -> int:
    """Adam's step count: in the param groups (TE/apex fused Adam) or per parameter (torch Adam); one value for all."""
    steps = set()
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            per_parameter = [inner.state.get(param, {}).get("step") for param in group["params"]]
            per_parameter = [int(v) for v in per_parameter if v is not None]
            # torch Adam counts per parameter and never reads a group's "step": a resumed DistributedOptimizer's
            # groups carry the checkpoint's count (with_optimizer_step), which then stays behind; fused Adam counts
            # in the group alone.
            steps.update(per_parameter or ([int(group["step"])] if "step" in group else []))
    if len(steps) > 1:
        raise RuntimeError(f"optimizer parameters disagree on Adam's step count: {sorted(steps)}")
    return steps.pop() if steps else 0


def _set_per_parameter_step(optimizer: Any, step: int) -> None:
    """torch Adam (no TE or apex) keeps a `step` tensor per parameter, which megatron's dp_reshardable load copies from
    the state dict it built to load into (the fresh optimizer's, step 0; the format does not store it): set each to
    the checkpoint's step count, a tensor of its own (Adam increments them in place)."""
    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.full_like(state["step"], step)


def with_optimizer_step(optimizer: Any, state: Any, step: int) -> Any:
    """`state` (a megatron optimizer's state dict, to load) with Adam's step count set where each optimizer reads it:
    the DistributedOptimizer from its param groups, the plain one from `common_step` (torch Adam) or its param groups
    (fused Adam)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    subs = [state] if len(chained) == 1 else [state[i] for i in range(len(chained))]
    for inner, sub in zip(chained, subs):
        torch_state = sub.get("optimizer", sub)  # FP32Optimizer's is torch's own; the others nest it
        distributed = isinstance(inner, DistributedOptimizer)
        for group in torch_state["param_groups"]:
            if distributed or "step" in group:
                group["step"] = step
        if not distributed and isinstance(inner.optimizer, torch.optim.Adam) and torch_state["state"]:
            torch_state["state"]["common_step"] = torch.tensor(float(step))
    return state
