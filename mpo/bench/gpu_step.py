"""Train-step MFU of a ~1.5B-parameter MoE on one GPU: the trainer's own path (megatron-core GPTModel with the
Transformer Engine spec, bf16 body, FP32 LM head, megatron DDP + Adam, mpo's micro-batch runner and chunked
vocab-parallel log-probs) at world size 1 over NCCL.

MFU = model FLOPs of one step / (median step time x peak FLOP/s). Model FLOPs count what the model needs, not what the
run spends (recomputation is not counted): per token, forward = 2 x the matmul parameters a token goes through
(attention, router, its top-k experts, LM head; the embedding is a lookup) + causal attention scores and values
(2 x 2 x seq/2 x heads x head_dim per layer); a training step is 3x the forward (backward = 2x). The peak defaults to
the H100 SXM dense bf16 figure (989 TFLOP/s); pass --peak-tflops for another GPU. The last line printed is the MFU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass

H100_BF16_DENSE_TFLOPS = 989.0


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts of an MoE model from its HF tensor shapes.

    Attributes:
        total: every parameter.
        active: parameters one token uses (experts scaled by top-k / experts).
        active_matmul: the active parameters that are matmul weights (no embedding lookup, no norms): what the
            FLOP count multiplies by 2 per token.
    """

    total: int
    active: int
    active_matmul: int


def parameter_counts(model_cfg) -> ParameterCounts:
    """Counts from the HF<->megatron mapping's tensor shapes (the same shapes conversion and weight sync use)."""
    from mpo.models.hf_mapping import mapping_for

    total = active = matmul = 0
    expert_share = model_cfg.router_topk / model_cfg.num_experts
    for unit in mapping_for(model_cfg, spec="local").units():
        n = sum(math.prod(shape) for shape in unit.rule.hf_shapes)
        used = n * expert_share if unit.rule.scope == "expert" else n
        total += n
        active += used
        is_matrix = all(len(shape) == 2 for shape in unit.rule.hf_shapes)
        if is_matrix and not unit.rule.key.startswith("embedding."):
            matmul += used
    if model_cfg.tie_word_embeddings:  # the tied head is a matmul with the embedding's weights
        matmul += model_cfg.vocab_size * model_cfg.hidden_size
    return ParameterCounts(total, round(active), round(matmul))


def train_flops_per_token(model_cfg, seq_length: int) -> float:
    """Model FLOPs of one training step per token (module docstring)."""
    counts = parameter_counts(model_cfg)
    attention = 2 * 2 * (seq_length / 2) * model_cfg.num_attention_heads * model_cfg.head_dim * model_cfg.num_layers
    return 3 * (2 * counts.active_matmul + attention)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench gpu_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpu_1b", help="model preset (mpo.models.config.PRESETS)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, TE autotuning)")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                        help="the GPU's dense bf16 peak in TFLOP/s (default: H100 SXM)")
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation (not counted)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile one step and print the 15 ops that take most GPU time")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("mpo.bench gpu_step needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mpo.bench._util import init_single_rank
    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.models.ddp import wrap_ddp
    from mpo.models.forward import MicroBatch, run_microbatches

    ctx = init_single_rank()
    cfg = preset(args.preset)
    if args.seq > cfg.max_position_embeddings:
        cfg = cfg.with_overrides(max_position_embeddings=args.seq)
    model = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype="bf16", fp32_lm_head=True),
                        recompute=args.recompute)
    ddp = wrap_ddp(model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, clip_grad=1.0,
                                                       weight_decay=0.0), [ddp])
    generator = torch.Generator().manual_seed(0)
    microbatches = [MicroBatch(torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq),
                                             generator=generator).to(ctx.device.device))
                    for _ in range(args.micro_batches)]
    tokens = args.micro_batch * args.seq * args.micro_batches

    def train_step() -> None:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_microbatches(ddp, microbatches, vocab_size=cfg.vocab_size,
                         loss_fn=lambda mb, logprobs, entropy: (-logprobs.sum() / tokens, {}))
        optimizer.step()

    for _ in range(args.warmup):
        train_step()
    torch.cuda.synchronize()
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    step_s = statistics.median(seconds)
    counts = parameter_counts(cfg)
    flops = train_flops_per_token(cfg, args.seq) * tokens
    achieved = flops / step_s
    mfu = achieved / (args.peak_tflops * 1e12)
    print(f"{args.preset}: {counts.total / 1e9:.2f}B parameters, {counts.active / 1e9:.2f}B active per token; "
          f"{torch.cuda.get_device_name()} ({ctx.device.layer_spec} spec, bf16 body, fp32 head)")
    print(f"step of {args.micro_batches} x {args.micro_batch} x {args.seq} = {tokens} tokens: median "
          f"{step_s * 1e3:.1f} ms over {args.steps} (min {min(seconds) * 1e3:.1f}), {tokens / step_s:.0f} tok/s, "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(f"model FLOPs {flops / 1e12:.1f} TFLOP/step -> {achieved / 1e12:.1f} TFLOP/s of {args.peak_tflops:g} peak")
    if args.profile:
        print_profile(train_step)
    print(f"MFU {mfu:.3f}")
    torch.distributed.destroy_process_group()
    return 0


def print_profile(train_step) -> None:
    """One step under torch.profiler: the ops that take most GPU time, so an MFU number comes with its cause."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
