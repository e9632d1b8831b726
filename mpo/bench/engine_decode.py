"""mpo's engine generating one demo step's batch, in this process, against HF `generate` on the same weights.

mpo: MpoGenerator over EngineModel (the tiny preset, seeded; what `python -m mpo.engine` serves, without HTTP), one
batched submit of the demo's rows (`data.prompts_per_step` prompts x `rollout.samples_per_prompt`, the toy task's
draw, seeded sampling, routed experts on as the demo asks for them), timed from submit to the last response.
Reference: transformers' Qwen3-MoE holding the same weights (the engine's own HF export), `generate` with a KV cache
on the same rows (left-padded), same temperature and token budget. The engine computes with the same transformers
modeling, so the ratio is the engine's own cost around the forwards: its batch scheduling, each row's seeded sampling,
the behaviour log-probs and the routes it records, the responses it builds. Both at `--threads` torch threads. Each
side runs `--reps` batches after one warm-up; the minimum and the median are printed.

Last line: `engine-decode mpo_s=<min a> reference_s=<min b> ratio=<a/b>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _timed(fn, reps: int) -> list[float]:
    fn(0)  # warm-up
    times = []
    for rep in range(1, reps + 1):
        began = time.perf_counter()
        fn(rep)
        times.append(time.perf_counter() - began)
    return times


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench engine_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10, help="timed batches per side (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine process uses 1)")
    parser.add_argument("overrides", nargs="*", help="section.field=value for the demo config")
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    from mpo.config import RECIPES
    from mpo.config_checks import load_config, model_config
    from mpo.engine.generator import MpoGenerator
    from mpo.engine.model import EngineModel
    from mpo.models.config import to_hf_config
    from mpo.parallel.ports import free_port
    from mpo.rollout.protocol import SamplingParams
    from mpo.trainer.tasks import make_task

    torch.set_num_threads(args.threads)
    config = load_config(RECIPES / "demo_cpu.yaml", args.overrides)
    cfg, rollout, task = model_config(config), config.rollout, make_task(config)
    G = rollout.samples_per_prompt
    budget = min(rollout.max_new_tokens, task.max_answer_tokens or rollout.max_new_tokens)
    engine = EngineModel.create(preset=config.model.preset, mcore_dir=None, seed=config.seed, dtype="fp32",
                                fp32_lm_head=True, dist_port=free_port())
    generator = MpoGenerator(engine, vocab_size=engine.vocab_size, max_batch=256)

    def rows(rep: int) -> list[list[int]]:
        return [list(p.ids) for p in task.draw(rep, config.data.prompts_per_step) for _ in range(G)]

    def mpo_batch(rep: int) -> None:
        batch = rows(rep)
        params = [SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, max_new_tokens=budget,
                                 stop_token_ids=task.stop_token_ids, sampling_seed=rep * len(batch) + i)
                  for i in range(len(batch))]
        generator.submit_many(batch, params, routed_experts=True)

    with tempfile.TemporaryDirectory(prefix="mpo-engine-decode-") as tmp:  # the engine's weights as HF files
        save_file({name: t.contiguous() for name, t in engine.hf_weights()}, f"{tmp}/model.safetensors",
                  metadata={"format": "pt"})
        Path(tmp, "config.json").write_text(json.dumps(to_hf_config(cfg)))
        hf = Qwen3MoeForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    eos = task.stop_token_ids[0]

    def reference_batch(rep: int) -> None:
        batch = rows(rep)
        width = max(len(r) for r in batch)
        ids = torch.tensor([[eos] * (width - len(r)) + r for r in batch])
        attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=rollout.temperature,
                        top_k=0, top_p=rollout.top_p, max_new_tokens=budget, eos_token_id=eos, pad_token_id=eos,
                        use_cache=True)

    try:
        mpo_times = _timed(mpo_batch, args.reps)
    finally:
        generator.stop()
    ref_times = _timed(reference_batch, args.reps)
    print(f"demo step's batch: {len(rows(0))} rows of {len(rows(0)[0])} prompt tokens, up to {budget} new tokens; "
          f"{args.reps} batches each, {args.threads} thread(s)")
    for name, times in (("mpo engine", mpo_times), ("reference (HF generate)", ref_times)):
        print(f"{name:26s} min {min(times):.4f} s  median {statistics.median(times):.4f} s")
    print(f"engine-decode mpo_s={min(mpo_times):.4f} reference_s={min(ref_times):.4f} "
          f"ratio={min(mpo_times) / min(ref_times):.2f}")
    return 0
