"""Per-rank body of the CPU-shim tests: for every shim, the megatron call it exists for must work with the shim and
fail without it. Runs on 2 real gloo ranks because some sites (uneven all-gather, DDP) only exist with a group."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Callable

import torch


def _tiny_model(layout: dict | None = None):
    from mpo.models.builder import build_model
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig
    from mpo.parallel.device import detect_device

    return build_model(preset("tiny-2layer"), ParallelConfig(**(layout or {})), detect_device())


def scenario_rng() -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)


def scenario_current_device() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding(kv_channels=16, rotary_percent=1.0)


def scenario_cuda_factories() -> None:
    from megatron.core.transformer.utils import get_default_causal_mask

    assert get_default_causal_mask(5).device.type == "cpu"


def scenario_alltoall() -> None:
    # A fresh model (new dispatchers) forward: dispatcher __init__ and the split-size host copy. EP2: at EP1 the
    # builder picks megatron's allgather dispatcher (nothing to exchange), which has no such copy.
    model = _tiny_model({"expert_parallel": 2})
    ids = torch.randint(0, 256, (1, 8))
    model(ids, torch.arange(8)[None], None)


def scenario_norm_sp() -> None:
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = copy.copy(_tiny_model().config)
    config.sequence_parallel = True
    norm = WrappedTorchNorm(config, 64)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())


def scenario_uneven_gloo() -> None:
    from megatron.core.tensor_parallel import mappings

    group = torch.distributed.group.WORLD
    rank = torch.distributed.get_rank()
    local = torch.full((rank + 1, 3), float(rank))
    gathered = mappings._gather_along_first_dim(local, group, output_split_sizes=[1, 2])
    assert gathered.tolist() == [[0.0] * 3, [1.0] * 3, [1.0] * 3]
    reduced = mappings._reduce_scatter_along_first_dim(torch.ones(3, 2), group, input_split_sizes=[1, 2])
    assert reduced.shape[0] == rank + 1 and bool((reduced == 2).all())


def scenario_synchronize() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    FileSystemWriterAsync.preload_tensors([], non_blocking=True)


def scenario_current_stream() -> None:
    from mpo.models.ddp import wrap_ddp
    from mpo.models.forward import MicroBatch, run_microbatches

    model = wrap_ddp(_tiny_model())
    run_microbatches(model, [MicroBatch(torch.randint(0, 256, (1, 8)))], vocab_size=256,
                     loss_fn=lambda mb, lp, ent: (lp.sum(), {}))


def scenario_tensor_type_strings() -> None:
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=2.0)


def scenario_adam_step_state() -> None:
    """A fresh DistributedOptimizer (torch Adam) builds the sharded state dict a resume loads into; after a step,
    megatron's reshardable load hands each parameter its state without `step`."""
    from mpo.models.ddp import make_optimizer, wrap_ddp
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.trainer.dist_checkpoint import OPTIMIZER_SHARDING

    model = wrap_ddp(_tiny_model(), distributed_optimizer=True)
    optimizer = make_optimizer(model, lr=1e-3, clip_grad=1.0, bf16=False)
    optimizer.sharded_state_dict(model.module.sharded_state_dict(), is_loading=True, metadata=OPTIMIZER_SHARDING)
    run_microbatches(model, [MicroBatch(torch.randint(0, 256, (1, 8)))], vocab_size=256,
                     loss_fn=lambda mb, lp, ent: (lp.sum(), {}))
    optimizer.step()
    inner = optimizer.chained_optimizers[0]
    param = next(p for p in inner.model_param_group_index_map)
    group, order = inner.model_param_group_index_map[param]
    state = inner.optimizer.state[inner.optimizer.param_groups[group]["params"][order]]
    with torch.no_grad():  # as in megatron's load
        inner._set_main_param_and_optimizer_states(param, {k: v.clone() for k, v in state.items() if k != "step"}
                                                   | {"param": inner.optimizer.param_groups[group]["params"][order]})


def scenario_ckpt_exchange() -> None:
    """A fully parallel load's exchange: rank 0 read a shard both ranks need and broadcasts it to rank 1."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.exchange_utils import ShardDistribution, exchange_loaded_tensors_broadcast
    from megatron.core.dist_checkpointing.utils import _sharded_tensor_shard_id

    rank = torch.distributed.get_rank()
    shard = ShardedTensor.from_rank_offsets("x", torch.zeros(4))
    shard_id = _sharded_tensor_shard_id(shard)
    shard.data = None  # what the loading rank has not read
    distribution = ShardDistribution({shard_id: 0}, {shard_id}, {shard_id: shard}, {shard_id: [0, 1]})
    loaded = {shard_id: torch.arange(4.0)} if rank == 0 else {}
    result = exchange_loaded_tensors_broadcast(loaded, {} if rank == 0 else {shard_id: shard}, distribution,
                                               torch.distributed.group.WORLD)
    assert result[shard_id].tolist() == [0.0, 1.0, 2.0, 3.0]


def scenario_cp_rope() -> None:
    """Context parallelism's rotary embedding on 2 ranks: rank r keeps chunks r and 3 - r of 4."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    rank = torch.distributed.get_rank()
    emb = torch.arange(8.0).view(8, 1, 1, 1)
    out = rope.get_pos_emb_on_this_cp_rank(emb, 0, torch.distributed.group.WORLD)
    chunks = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert out.flatten().tolist() == chunks[rank] + chunks[3 - rank]


SCENARIOS: dict[str, Callable[[], None]] = {
    name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")
}


def run(out_file: str) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.parallel.cpu_shims import SHIMS

    initialize_parallel(ParallelConfig())
    results = {}
    for name, shim in SHIMS.items():
        scenario = SCENARIOS[name]
        record = {"applied": shim.applied}
        try:
            scenario()
            record["works_with"] = True
        except Exception:
            record["works_with"] = False
            record["error_with"] = traceback.format_exc(limit=3)
        torch.distributed.barrier()
        with shim.removed():
            try:
                scenario()
                record["fails_without"] = False
            except Exception as exc:  # noqa: BLE001 - any failure proves the shim is needed
                record["fails_without"] = True
                record["error_without"] = f"{type(exc).__name__}: {exc}"[:300]
        model_parallel_cuda_manual_seed(1234)  # a failed scenario may have left the RNG tracker half reset
        torch.distributed.barrier()
        record["restored"] = shim.applied
        results[name] = record
    if torch.distributed.get_rank() == 0:
        Path(out_file).write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
