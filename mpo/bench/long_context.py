"""Long-context head memory: today's FP32 head (whole fp32 logits, then chunked log-probs) against the fused head.

One training forward+backward over one sequence of `--tokens` tokens (16k by default) with a real large vocabulary
(151,936, Qwen3's) and a small hidden size, each variant in a fresh process: a token-wise body (embedding, a two-layer
MLP with a residual, a norm) and the FP32 LM head, a policy-gradient-like loss on log-probs and entropies. Attention is
left out on purpose: at 16k tokens the local spec's unfused attention would dwarf the head, and the head is what this
measures. The head's peak is the process's RSS high-water mark during the head's forward+backward minus its RSS just
before it (the body's activations are already resident). Both variants see the same weights and tokens.

Context parallelism: the tiny MoE (megatron-core, local spec) scores one `--cp-tokens`-token sequence at CP1 (one gloo
rank) and at CP2 (two ranks, megatron's split into 4 chunks, mpo.models.context_parallel's attention); c is the largest
log-prob difference. The CP check runs on the tiny model, not the head model above: CP splits attention, which the
head model leaves out.

Last line: `long-context head_peak_ratio=<a> max_logprob_diff=<b> cp2_vs_cp1_diff=<c>`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

QWEN3_VOCAB = 151_936


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _variant(name: str, tokens: int, vocab: int, hidden: int, queue) -> None:
    import torch

    from mpo.models.fused_head import fused_head_logprobs
    from mpo.models.logprobs import vocab_parallel_logprobs

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen) * 0.02)
    up = torch.nn.Parameter(torch.randn(4 * hidden, hidden, generator=gen) / hidden ** 0.5)
    down = torch.nn.Parameter(torch.randn(hidden, 4 * hidden, generator=gen) / (4 * hidden) ** 0.5)
    head = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5 * 2)
    ids = torch.randint(0, vocab, (tokens + 1,), generator=gen)
    advantages = torch.randn(tokens, generator=gen)

    x = embed[ids[:-1]]
    x = x + torch.nn.functional.gelu(x @ up.t()) @ down.t()
    x = torch.nn.functional.rms_norm(x, (hidden,))
    labels = ids[1:]
    before = _rss_mib()
    start = time.perf_counter()
    if name == "fused":
        logp, entropy = fused_head_logprobs(x, head, labels, vocab_size=vocab)
    else:  # today's: the head's whole fp32 logits, then the chunked vocab-parallel log-probs over them
        logp, entropy = vocab_parallel_logprobs(x @ head.t(), labels, vocab_size=vocab)
    loss = -(logp * advantages).mean() - 0.01 * entropy.mean()
    loss.backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    queue.put((name, peak, elapsed, logp.detach().tolist(), head.grad.norm().item()))  # plain data: the child exits


def _cp_rank(rank: int, world: int, port: int, tokens: int, out: str) -> None:
    import torch

    from megatron.core import parallel_state as ps

    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.models.context_parallel import gather_from_context_parallel, split_for_context_parallel
    from mpo.models.logprobs import vocab_parallel_logprobs
    from mpo.parallel import ParallelConfig, initialize_parallel

    torch.set_num_threads(1)
    cfg = preset("tiny-2layer")
    ctx = initialize_parallel(ParallelConfig(context_parallel=world), rank=rank, world_size=world,
                              master_addr="127.0.0.1", master_port=port, num_layers=cfg.num_layers,
                              num_experts=cfg.num_experts)
    model = build_model(cfg, ctx.parallel, ctx.device, PrecisionConfig(dtype="fp32", fp32_lm_head=True))
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    cp_rank = ps.get_context_parallel_rank()
    local = lambda x: split_for_context_parallel(x, cp_rank, world)  # noqa: E731
    with torch.no_grad():
        logits = model(local(ids), local(torch.arange(tokens)[None]), None)
        logp, _ = vocab_parallel_logprobs(logits, local(labels), vocab_size=cfg.vocab_size)
    logp = gather_from_context_parallel(logp, ps.get_context_parallel_group())
    if rank == 0:
        torch.save(logp, out)
    torch.distributed.destroy_process_group()


def cp2_vs_cp1(tokens: int) -> float:
    """Largest |log p| difference between CP2 and CP1 on one sequence of the tiny MoE (fresh processes)."""
    import tempfile

    import torch

    from mpo.parallel.ports import free_port

    ctx = mp.get_context("spawn")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            out, port = f"{tmp}/cp{world}.pt", free_port()
            procs = [ctx.Process(target=_cp_rank, args=(r, world, port, tokens, out)) for r in range(world)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
                if proc.exitcode:
                    raise RuntimeError(f"context-parallel rank failed (CP{world}, exit {proc.exitcode})")
            results.append(torch.load(out, weights_only=True))
    return (results[0] - results[1])[:, :-1].abs().max().item()  # the last token has no next token


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench long_context", description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--cp-tokens", type=int, default=2048, help="sequence of the CP2 vs CP1 check")
    args = parser.parse_args(argv)

    whole_gib = args.tokens * args.vocab * 4 / 2**30
    print(f"one sequence of {args.tokens} tokens, vocabulary {args.vocab}, hidden {args.hidden}, FP32 head "
          f"(whole fp32 logits: {whole_gib:.1f} GiB, and as much again for their gradient)", flush=True)
    from mpo.bench._util import in_fresh_processes

    results = in_fresh_processes(_variant, ("whole_logits", "fused"), args.tokens, args.vocab, args.hidden)
    for name, (_, peak, elapsed, _, grad_norm) in results.items():
        print(f"  {name:12s} head peak {peak:9.0f} MiB   fwd+bwd {elapsed:7.1f} s   |grad head| {grad_norm:.6g}",
              flush=True)
    whole, fused = results["whole_logits"], results["fused"]
    ratio = fused[1] / whole[1]
    diff = max(abs(a - b) for a, b in zip(fused[3], whole[3]))
    cp_diff = cp2_vs_cp1(args.cp_tokens)
    print(f"  CP2 vs CP1 on one {args.cp_tokens}-token sequence (tiny MoE): max |log p| difference {cp_diff:.3g}")
    print(f"long-context head_peak_ratio={ratio:.4f} max_logprob_diff={diff:.3g} cp2_vs_cp1_diff={cp_diff:.3g}")
    return 0
