"""Trainer side of the real-SGLang sync tests: mpo's megatron model, loaded from the torch_dist conversion of the
server's own HF checkpoint, in a spawned gloo rank.

It (1) scores the sequences the server generated (log-probs and its own router top-k, mpo.routing hooks), then for
each transport (2) perturbs its weights as an optimizer step would, pushes them through WeightSync and checks the
server's probe log-probs against its own (verify_by_probe), recording the server's probe log-probs before and after,
and (3) pushes one more step that skips one expert of the last layer, recording what each verification said.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def _score(model, hooks, sequence: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from mpo.models.forward import MicroBatch, run_microbatches

    with torch.no_grad(), hooks.session() as capture:
        out = run_microbatches(model, [MicroBatch(torch.tensor([sequence]))], vocab_size=vocab_size)
    return out[0]["logprobs"][0].double(), capture.records[0].indices[0].to(torch.int32)


def run(out_file: str, mcore_dir: str, url: str, sequences: list[list[int]], probe: list[int],
        transports: list[str], bucket_bytes: int) -> None:
    from checkpoints_tools.convert import HF_CONFIG_NAME
    from mpo.models.hf_mapping import mapping_for, model_config_from_hf
    from checkpoints_tools.mcore_runner import load_checkpoint
    from mpo.models.builder import PrecisionConfig, build_model, unwrap
    from mpo.models.full_state import gather_full_state
    from mpo.parallel import ParallelConfig, initialize_parallel
    from mpo.rollout.client import EngineClient, EngineError
    from mpo.bench._util import push_whole
    from mpo.weight_sync.transports import WeightSync
    from mpo.weight_sync.verify import run_probes, verify_by_probe
    from mpo.routing import attach_routing_hooks

    cfg = model_config_from_hf(json.loads((Path(mcore_dir) / HF_CONFIG_NAME).read_text()))
    parallel = ParallelConfig(sequence_parallel=False)
    ctx = initialize_parallel(parallel, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                              num_attention_heads=cfg.num_attention_heads)
    model = build_model(cfg, parallel, ctx.device, PrecisionConfig(dtype="fp32"))
    load_checkpoint(model, mcore_dir)
    model.eval()
    hooks = attach_routing_hooks(model)
    results: dict = {"logprobs": [], "routes": []}
    for seq in sequences:
        logprobs, routes = _score(model, hooks, seq, cfg.vocab_size)
        results["logprobs"].append(logprobs)
        results["routes"].append(routes)

    client = EngineClient(url)
    mapping = mapping_for(cfg, spec="local")
    previous = None
    for i, transport in enumerate(transports):
        before = run_probes(client, [probe])[0].logprobs
        generator = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for param in unwrap(model).parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
        named = list(mapping.full_state_to_hf(gather_full_state(unwrap(model))))
        own, _ = _score(model, hooks, probe, cfg.vocab_size)
        sync = WeightSync([client], engine="sglang", transport=transport, bucket_bytes=bucket_bytes)
        report = push_whole(sync, named, version=i)
        diff = verify_by_probe(sync.clients, [probe], [own.tolist()], tolerance=1e-3)
        stale = None
        if previous is not None:  # the previous step's reference must now fail the check, naming the engine
            try:
                verify_by_probe(sync.clients, [probe], [previous.tolist()], tolerance=1e-3)
            except EngineError as exc:
                stale = str(exc)
        sync.close()
        results[transport] = {"before": torch.tensor(before, dtype=torch.float64),
                              "after": torch.tensor(run_probes(client, [probe])[0].logprobs, dtype=torch.float64),
                              "trainer": own[1:], "probe_diff": diff, "stale_error": stale,
                              "bytes_per_s": report.bytes_per_s, "bytes": report.bytes, "seconds": report.seconds,
                              "buckets": report.buckets}
        previous = own
    results["stale_expert"] = _stale_expert(model, hooks, cfg, mapping, client, probe, bucket_bytes)
    torch.save(results, Path(out_file))
    torch.distributed.destroy_process_group()


def _stale_expert(model, hooks, cfg, mapping, client, probe: list[int], bucket_bytes: int) -> dict:
    """One more perturbed step, pushed without the tensors of one expert of the last layer: an expert that the
    probe's first 4 tokens (3 scored positions x top-k < num_experts picks) are not routed to by the trainer's own
    router, so a short probe misses it. Records the short probe's verdict, the covering probe's (built from the
    server's routed experts) and, after the full step is pushed, the covering probe's again."""
    from mpo.models.builder import unwrap
    from mpo.models.full_state import gather_full_state
    from mpo.rollout.client import EngineError
    from mpo.bench._util import push_whole
    from mpo.weight_sync.transports import WeightSync
    from mpo.weight_sync.verify import ProbeCoverage, covering_probes, run_probes, verify_by_probe

    generator = torch.Generator().manual_seed(300)
    with torch.no_grad():
        for param in unwrap(model).parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    named = list(mapping.full_state_to_hf(gather_full_state(unwrap(model))))
    short = probe[:4]
    short_lp, short_routes = _score(model, hooks, short, cfg.vocab_size)
    layer = cfg.num_layers - 1
    expert = min(set(range(cfg.num_experts)) - set(short_routes[: len(short) - 1, layer].flatten().tolist()))
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    stale = [(name, t) for name, t in named if not name.startswith(prefix)]
    sync = WeightSync([client], engine="sglang", transport="tensor", bucket_bytes=bucket_bytes)
    push_whole(sync, stale, version=1)
    out: dict = {"layer": layer, "expert": expert, "skipped": len(named) - len(stale)}
    out["short_diff"] = verify_by_probe(sync.clients, [short], [short_lp.tolist()], tolerance=1e-3)
    coverage = ProbeCoverage(num_experts=cfg.num_experts, num_layers=cfg.num_layers, topk=cfg.router_topk,
                             vocab_size=cfg.vocab_size, tokens_per_sequence=32)
    probes = covering_probes(client, [probe], coverage)
    runs = run_probes(client, probes, num_layers=cfg.num_layers, topk=cfg.router_topk)
    out["probe_tokens"] = sum(map(len, probes))
    out["stale_hits"] = sum(int((run.routes[:, layer] == expert).sum()) for run in runs)
    out["covered"] = [sorted(set(np.concatenate([run.routes[:, l].ravel() for run in runs]).tolist()))
                      for l in range(cfg.num_layers)]
    reference = [_score(model, hooks, p, cfg.vocab_size)[0].tolist() for p in probes]
    out["stale_error"] = None
    try:
        verify_by_probe(sync.clients, probes, reference, tolerance=1e-3)
    except EngineError as exc:
        out["stale_error"] = str(exc)
    push_whole(sync, named, version=2)
    out["full_diff"] = verify_by_probe(sync.clients, probes, reference, tolerance=1e-3)
    return out
