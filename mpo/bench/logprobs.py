"""Peak memory and time of mpo's chunked vocab-parallel log-probs vs materialising full fp32 log-softmax.

Each variant runs forward+backward (log-prob and entropy) on the same bf16 logits in a fresh process; peak extra
memory is the process's peak RSS minus its RSS after the logits were created. Both numbers come from this one run.
"""

from __future__ import annotations

import argparse
import resource
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _variant(name: str, tokens: int, vocab: int, chunk: int, queue) -> None:
    import torch

    torch.set_num_threads(1)
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    logits.requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,))
    baseline = _rss_mb()
    start = time.perf_counter()
    if name == "chunked":
        from mpo.models.logprobs import vocab_parallel_logprobs

        logp, entropy = vocab_parallel_logprobs(logits, labels, vocab_size=vocab, chunk_tokens=chunk)
    else:
        logsm = torch.log_softmax(logits.float(), dim=-1)
        logp = logsm.gather(-1, labels[:, None]).squeeze(-1)
        entropy = -(logsm.exp() * logsm).sum(-1)
    (logp.sum() + entropy.sum()).backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put((name, peak - baseline, elapsed))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench logprobs", description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    args = parser.parse_args(argv)

    from mpo.bench._util import in_fresh_processes

    results = in_fresh_processes(_variant, ("full_fp32", "chunked"), args.tokens, args.vocab, args.chunk_tokens)
    logits_mb = args.tokens * args.vocab * 2 / 2**20
    print(f"log-prob + entropy fwd+bwd on {args.tokens} tokens x {args.vocab} vocab, bf16 logits ({logits_mb:.0f} MiB)")
    for name, (_, peak, elapsed) in results.items():
        print(f"  {name:10s} peak extra memory {peak:8.0f} MiB   time {elapsed * 1e3:8.0f} ms")
    full, chunked = results["full_fp32"], results["chunked"]
    print(f"  ratio chunked/full: memory {chunked[1] / full[1]:.3f}, time {chunked[2] / full[2]:.3f}")
    return 0
