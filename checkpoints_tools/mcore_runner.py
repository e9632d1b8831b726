"""Per-rank body shared by `verify` and the tests: load a torch_dist checkpoint into mpo's model at a layout, run
fixed prompts, and write full (TP-gathered) logits, log-probs and per-layer router top-k to a file on rank 0.

Top-k experts come from a forward hook on each layer's megatron router (its routing_map), in megatron's
sequence-major [s, b] token order; they are returned in HF's batch-major [b, s] order.
Sequence parallelism is off: every TP rank's router sees all tokens (allowed for forward-only runs).
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_checkpoint(model: torch.nn.Module, mcore_dir: str | Path) -> None:
    """megatron's own loader (dist_checkpointing.load, through mpo.safe_load: no code runs from the files) +
    load_state_dict."""
    from mpo.safe_load import load_sharded

    wanted = model.sharded_state_dict()
    state = load_sharded(wanted, mcore_dir)
    # only the model's keys: a trainer checkpoint's common state also holds its optimizer's and RNG's entries
    model.load_state_dict({k: state[k] for k in wanted})


def _resave(model: torch.nn.Module, out: Path) -> None:
    from megatron.core import dist_checkpointing

    from mpo.models.full_state import gather_full_state

    (out / "megatron_saved").mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(out / "megatron_saved"))
    full = gather_full_state(model)
    if full is not None:
        torch.save(full, out / "full_state.pt")


def run_rank(mcore_dir: str, prompts: list[list[int]], layout: dict, out_file: str,
             resave_dir: str | None = None) -> None:
    """See the module docstring. With `resave_dir`, megatron also saves the loaded model there with its own
    dist_checkpointing.save (`megatron_saved/`) and writes gather_full_state's tensors (`full_state.pt`), so tests
    can compare this converter's output with megatron's own format."""
    from megatron.core import parallel_state

    from checkpoints_tools.convert import HF_CONFIG_NAME
    from mpo.models.builder import PrecisionConfig, build_model, unwrap
    from mpo.models.chunks import as_chunks
    from mpo.models.forward import MicroBatch, run_microbatches
    from mpo.models.hf_mapping import model_config_from_hf
    from mpo.models.hf_source import read_json
    from mpo.parallel import ParallelConfig, initialize_parallel

    hf_config = read_json(Path(mcore_dir) / HF_CONFIG_NAME)
    model_cfg = model_config_from_hf(hf_config)
    parallel = ParallelConfig(sequence_parallel=False, **layout)
    ctx = initialize_parallel(parallel, num_layers=model_cfg.num_layers, num_experts=model_cfg.num_experts,
                              num_attention_heads=model_cfg.num_attention_heads)
    model = build_model(model_cfg, parallel, ctx.device, PrecisionConfig(dtype="fp32"))
    load_checkpoint(model, mcore_dir)
    model.eval()
    if resave_dir is not None:
        _resave(model, Path(resave_dir))

    routing: dict[int, list[torch.Tensor]] = {}

    def hook(layer_index: int):
        def capture(_module, _inputs, output):
            routing_map = output[1]
            topk = routing_map.sum(-1).max().item()
            routing.setdefault(layer_index, []).append(
                torch.sort(routing_map.int().topk(int(topk), dim=-1).indices, dim=-1).values)
        return capture

    handles = []
    for chunk in as_chunks(unwrap(model)):
        for layer in chunk.decoder.layers:  # layer_number is global (1-based) under uneven and virtual stages
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                handles.append(router.register_forward_hook(hook(layer.layer_number - 1)))

    ids = torch.tensor(prompts, dtype=torch.long)
    # Virtual stages need a multiple of PP micro-batches (megatron's interleaved schedule): one prompt each.
    rows = 1 if parallel.virtual_pipeline_parallel else ids.shape[0]
    microbatches = [MicroBatch(ids[i:i + rows]) for i in range(0, ids.shape[0], rows)]
    with torch.no_grad():
        results = run_microbatches(model, microbatches, vocab_size=model_cfg.vocab_size, keep_logits=True)
    for handle in handles:
        handle.remove()

    s = ids.shape[1]
    # per micro-batch [s*rows, k] in megatron's sequence-major order -> [b*s, k] batch-major like HF.
    routing = {i: torch.cat([t.reshape(s, rows, -1).transpose(0, 1).reshape(rows * s, -1) for t in parts])
               for i, parts in routing.items()}
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, routing)
    all_routing = {layer: topk for part in gathered for layer, topk in part.items()}

    payload = None
    if results:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        local = torch.cat([r["logits"] for r in results]).contiguous()
        parts = [torch.empty_like(local) for _ in range(tp)]
        torch.distributed.all_gather(parts, local, group=tp_group)
        logits = torch.cat(parts, dim=-1)[..., : model_cfg.vocab_size]
        payload = {"logits": logits, "logprobs": torch.cat([r["logprobs"] for r in results])}
    payloads: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(payloads, payload)
    if torch.distributed.get_rank() == 0:
        payload = next(p for p in payloads if p is not None)
        payload["routing"] = all_routing
        torch.save(payload, out_file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
