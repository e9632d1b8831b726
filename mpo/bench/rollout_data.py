"""The rollout data path at a scaled-down but proportional Qwen3-30B-A3B shape (issue #31): what a step's samples cost
on the wire from the engine, on rank 0, and on every other rank.

Four gloo ranks as DP2 x PP2 build the real Trainer (preset `rollout_bench`: 48 MoE layers, 128 experts, top-8 on a
tiny width) and run its data path for a step: rank 0's `Collector.collect` (prompt draw, requests to the engine through
EngineClient and the rollout pool, decoding, scoring, advantages) and the distribution to every rank
(`Trainer.step_batch`, what `train_step` runs), then each rank builds its micro-batches and places its engine routes
(R3), as the old-logprob pass does. The engine is a stub in its own process that answers /generate in the wire
format mpo's engine answers with (the same encoding functions), with response lengths log-uniform in
[--min-len, --max-len] and random routes, a pure function of each request's sampling seed (the prompt's rows of the
prompt alone, as a prefill's are); `--wire sglang` makes it answer SGLang's JSON (base64 int32 routes) instead.

Measured (median over --repeats, after one warm-up step):
* bytes_per_rank_vs_share: the bytes a non-zero rank receives in the distribution (ReceivedBytes), over the bytes
  of that rank's own share in compact form (share_bytes). The worst non-zero rank is reported.
* route_bytes_per_token: bytes of the engine's responses' routes on the wire, per generated token (the routes cover the
  prompt's positions too, for R3's replay of them; a call's samples of one prompt send those once: mpo.rollout.frames).
* rank0_s_per_mtoken: rank 0's CPU seconds (its process, every thread) in collect + distribute, per million generated
  tokens. CPU time, not wall time: the stub engine shares the machine's cores, its time is not rank 0's.

Last line: `rollout-data bytes_per_rank_vs_share=<x> route_bytes_per_token=<y> rank0_s_per_mtoken=<z>`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS_PER_GROUP = 8


# -- the stub engine ---------------------------------------------------------------------------------------------------
def stub_row(prompt: list[int], seed: int, *, min_len: int, max_len: int, num_layers: int, topk: int,
             num_experts: int, version: int = 0):
    """One response of the stub engine, a pure function of (prompt, seed): completion ids, log-probs, per-token
    versions and routes [prompt + completion - 1, layers, top_k] (top_k distinct experts per token and layer). The
    rows of the prompt's positions depend on the prompt alone, as a real engine's prefill does."""
    import zlib

    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(round(math.exp(rng.uniform(math.log(min_len), math.log(max_len)))))
    output = rng.integers(4, 256, n)
    logprobs = -rng.random(n).astype(np.float32)
    prefill = np.random.default_rng(zlib.crc32(np.asarray(prompt, dtype=np.int64).tobytes()))
    base = np.concatenate([prefill.integers(0, num_experts, (len(prompt), num_layers, 1)),
                           rng.integers(0, num_experts, (n - 1, num_layers, 1))])
    routes = (base + np.arange(topk) * (num_experts // topk)) % num_experts
    return output, logprobs, [version] * n, routes


def _stub_response(prompt: list[int], params: dict, args) -> dict:
    """The answer mpo's engine gives for one row (mpo.engine.generator's fields; routes compact, as it keeps them)."""
    from mpo.rollout.protocol import compact_routes

    output, logprobs, versions, routes = stub_row(prompt, params["sampling_seed"], min_len=args.min_len,
                                                  max_len=args.max_len, num_layers=args.layers, topk=args.topk,
                                                  num_experts=args.experts)
    meta = {"id": None, "finish_reason": {"type": "stop"}, "prompt_tokens": len(prompt),
            "completion_tokens": len(output), "cached_tokens": 0, "weight_version": "0", "e2e_latency": 0.0,
            "output_token_logprobs": [[float(lp), int(t), None] for lp, t in zip(logprobs, output)],
            "output_token_logprobs_length": len(output), "output_token_weight_versions": versions,
            "input_token_logprobs": [], "routed_experts": compact_routes(routes, args.experts)}
    return {"text": "", "output_ids": output.tolist(), "meta_info": meta}


def _serve(port: int, args, stats: str) -> None:
    """The stub engine; appends each /generate call's route bytes on the wire and generated tokens to `stats`."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _reply(self, payload, routes: list | None = None) -> None:
            # as mpo's engine server answers (mpo.engine.server: _reply), or SGLang's JSON with --wire sglang
            from mpo.rollout.frames import CONTENT_TYPE, encode_frames, frames_answer, sglang_json, wants_frames
            from mpo.rollout.protocol import encode_routed_experts

            if args.wire == "mpo" and wants_frames(self.headers.get("Accept")):
                framed = frames_answer(payload)
                data, content_type = encode_frames(framed), CONTENT_TYPE
                route_bytes = sum(a["meta_info"]["routed_experts"].nbytes
                                  for a in (framed if isinstance(framed, list) else [framed])) if routes else 0
            else:
                data, content_type = json.dumps(sglang_json(payload)).encode(), "application/json"
                route_bytes = sum(len(encode_routed_experts(r)) for r in routes or [])
            if routes:
                with open(stats, "a") as f:
                    f.write(json.dumps({"route_bytes": route_bytes, "tokens": self.tokens,
                                        "positions": sum(r.shape[0] for r in routes)}) + "\n")
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply({"success": True})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, params = body["input_ids"], body["sampling_params"]
            batch = isinstance(ids[0], list)
            rows = ids if batch else [ids]
            params = params if isinstance(params, list) else [params] * len(rows)
            answers = [_stub_response(r, p, args) for r, p in zip(rows, params)]
            self.tokens = sum(len(a["output_ids"]) for a in answers)
            self._reply(answers if batch else answers[0], [a["meta_info"]["routed_experts"] for a in answers])

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


# -- byte counting at torch.distributed ------------------------------------------------------------------------------
class ReceivedBytes:
    """Bytes of the payload tensors this rank receives through broadcast (when not the source), scatter (when not
    the source) and irecv (which recv calls), counted by wrapping torch.distributed's functions (independent of
    mpo's code)."""

    def __init__(self, rank: int) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.total = 0

        def wrap(name: str, receiving):
            original = getattr(c10d, name)

            def wrapped(*a, **kw):
                out = original(*a, **kw)
                tensor = receiving(*a, **kw)
                if tensor is not None:
                    self.total += tensor.numel() * tensor.element_size()
                return out

            for module in (c10d, dist):
                setattr(module, name, wrapped)

        def broadcast_recv(tensor, src=None, group=None, async_op=False, group_src=None):
            s, mine = (group_src, c10d.get_rank(group)) if group_src is not None else (src, rank)
            return None if s == mine else tensor

        def scatter_recv(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
            return broadcast_recv(tensor, src, group, async_op, group_src)

        wrap("broadcast", broadcast_recv)
        wrap("scatter", scatter_recv)
        wrap("irecv", lambda tensor, *a, **kw: tensor)  # recv is irecv + wait (torch 2.14): counted once


def share_bytes(samples, stage_layers: int, topk: int, num_experts: int) -> int:
    """A share's bytes in compact form: ids, log-probs and versions at 4 bytes a token, routes of the stage's
    layers at one byte (two above 256 experts) per expert slot."""
    route_item = 1 if num_experts <= 256 else 2
    return sum(4 * len(s.ids) + 8 * (len(s.ids) - s.prompt_len) + (len(s.ids) - 1) * stage_layers * topk * route_item
               for s in samples)


def _rank(rank: int, world: int, port: int, engine_port: int, args, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.rollout.client import EngineClient
    from mpo.trainer.rollouts import Rollouts
    from mpo.trainer.trainer import Trainer

    config = load_config(RECIPES / "demo_cpu.yaml", [
        f"world_size={world}", "parallel.expert_parallel=1", f"parallel.pipeline_parallel={args.pp}",
        "model.preset=rollout_bench", "algorithm.replay=r3", "algorithm.filter_zero_variance=false",
        f"data.prompts_per_step={args.samples // PROMPTS_PER_GROUP}",
        f"rollout.samples_per_prompt={PROMPTS_PER_GROUP}", f"logging.out_dir={out}/run", "logging.tensorboard=false",
        "schedule.micro_batch_size=16"])
    trainer = Trainer(config)
    rollouts = Rollouts.beside(trainer)
    if rank == 0:
        rollouts.collector.connect([(EngineClient(f"http://127.0.0.1:{engine_port}", num_layers=args.layers,
                                                 topk=args.topk, num_experts=args.experts, timeout_s=600.0), None)])
    received = ReceivedBytes(rank)
    rows = []
    for repeat in range(args.repeats + 1):
        dist.barrier()
        received.total = 0
        wall, cpu = time.perf_counter(), time.process_time()
        samples, _ = trainer.step_batch(repeat, rollouts.collect)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        got = received.total
        # what this rank trains on: the real rows of its micro-batches, with R3's routes placed (old-logprob pass)
        mbs = [mb for mbs in trainer.pass_microbatches([samples[u::config.schedule.updates_per_step]
                                                        for u in range(config.schedule.updates_per_step)])
               for mb in mbs]
        mine = [s for mb in mbs for s in mb.extras["samples"][: mb.extras["n_real"]]]
        for mb in mbs:
            placed = trainer.policy.engine_routes(mb)
            assert placed is not None and placed.select(trainer.routing.layers).indices.shape[2] == \
                len(trainer.routing.layers)
        del mbs
        generated = sum(len(s.ids) - s.prompt_len for s in samples) if rank == 0 else 0
        rows.append({"wall": wall, "cpu": cpu, "received": got, "generated": generated,
                     "share": share_bytes(mine, len(trainer.routing.layers), args.topk, args.experts)})
        del samples
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows[1:], group=trainer.ctx.object_group)
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench rollout_data", description=__doc__)
    parser.add_argument("--samples", type=int, default=256, help="responses per step (groups of 8)")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=48, help="must match the rollout_bench preset")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages; DP = 4 / pp")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--wire", choices=("mpo", "sglang"), default="mpo",
                        help="the stub answers as mpo's engine (binary frames when asked) or as SGLang (JSON)")
    args = parser.parse_args(argv)

    import multiprocessing

    import torch.multiprocessing as mp

    from mpo.parallel.ports import free_port

    world = 4
    engine_port = free_port()
    with tempfile.TemporaryDirectory(prefix="mpo-bench-rollout-data-") as out:
        stats = str(Path(out, "stub.jsonl"))
        stub = multiprocessing.get_context("spawn").Process(target=_serve, args=(engine_port, args, stats),
                                                            daemon=True)
        stub.start()
        try:
            mp.start_processes(_rank, args=(world, free_port(), engine_port, args, out), nprocs=world, join=True,
                               start_method="spawn")
        finally:
            stub.terminate()
            stub.join()
        gathered = json.loads(Path(out, "result.json").read_text())
        calls = [json.loads(line) for line in Path(stats).read_text().splitlines()]
    wire, tokens = sum(c["route_bytes"] for c in calls), sum(c["tokens"] for c in calls)
    positions = sum(c["positions"] for c in calls)
    generated = statistics.median(r["generated"] for r in gathered[0])
    ratios = {rank: statistics.median(r["received"] / max(r["share"], 1) for r in rows)
              for rank, rows in enumerate(gathered) if rank}
    worst = max(ratios, key=ratios.get)
    cpu = statistics.median(r["cpu"] for r in gathered[0])
    wall = statistics.median(r["wall"] for r in gathered[0])
    print(f"{args.samples} samples, {generated:.0f} generated tokens a step (log-uniform "
          f"{args.min_len}..{args.max_len}), {args.layers} MoE layers, top-{args.topk} of {args.experts}; 4 gloo ranks "
          f"as DP{world // args.pp} x PP{args.pp}; median of {args.repeats}")
    for rank, rows in enumerate(gathered):
        received, share = (statistics.median(r[k] for r in rows) / 1e6 for k in ("received", "share"))
        print(f"  rank {rank}: received {received:9.1f} MB, own share {share:8.1f} MB, "
              f"wall {statistics.median(r['wall'] for r in rows):6.2f} s")
    print(f"  rank 0 collect + distribute: {cpu:.2f} s CPU, {wall:.2f} s wall; routes on the wire ({args.wire}): "
          f"{wire / positions:.1f} bytes per routed position (prompt positions are routed too)")
    print(f"rollout-data bytes_per_rank_vs_share={ratios[worst]:.2f} route_bytes_per_token={wire / tokens:.1f} "
          f"rank0_s_per_mtoken={cpu / generated * 1e6:.2f}")
    return 0
