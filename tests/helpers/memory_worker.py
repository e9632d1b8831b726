"""Per-rank body of the memory-plan test: build the policy at a layout (bf16, fp32 LM head), wrap it in megatron DDP,
create megatron's optimizer (with and without the distributed optimizer), allocate its Adam state as megatron does
before loading a checkpoint (init_state_fn), and count the bytes of the tensors that really exist."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Big enough that megatron's 64-element alignment of the distributed optimizer's buffers stays well under 1%.
MODEL = dict(vocab_size=512, hidden_size=128, num_layers=4, num_attention_heads=4, num_query_groups=2, head_dim=32,
             moe_ffn_hidden_size=64, num_experts=8, router_topk=2)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def run(out_dir: str, layout: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.chunks import as_chunks
    from mpo.models.config import MoEModelConfig
    from mpo.models.ddp import wrap_ddp
    from mpo.parallel import ParallelConfig, initialize_parallel

    cfg = MoEModelConfig(**MODEL)
    parallel = ParallelConfig(**layout)
    ctx = initialize_parallel(parallel, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                              num_attention_heads=cfg.num_attention_heads)
    result: dict = {"pp_rank": parallel_state.get_pipeline_model_parallel_rank()}
    for distributed in (False, True):
        model = wrap_ddp(build_model(cfg, parallel, ctx.device, PrecisionConfig(dtype="bf16")),
                         distributed_optimizer=distributed)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, weight_decay=0.0,
                            use_distributed_optimizer=distributed), as_chunks(model))
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner.init_state_fn(inner.optimizer, inner.config)
        params = list(model.parameters())
        model_storages = {p.untyped_storage().data_ptr() for p in params}
        grads = sum(_bytes(buffer.grad_data) for chunk in as_chunks(model)
                    for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers])
        seen, state = set(), 0
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            torch_opt = inner.optimizer
            tensors = [p for group in torch_opt.param_groups for p in group["params"]]
            tensors += [t for s in torch_opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            for t in tensors:
                ptr = t.untyped_storage().data_ptr()
                if ptr in model_storages or ptr in seen:  # the model's own weights (fp32 head), or counted
                    continue
                seen.add(ptr)
                state += t.untyped_storage().nbytes()
        result["distributed" if distributed else "plain"] = {
            "params": sum(_bytes(p) for p in params), "grads": grads, "optimizer": state}
    out = Path(out_dir) / f"rank{torch.distributed.get_rank()}.json"
    out.write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
