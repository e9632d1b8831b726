"""Forward+backward time of the tiny MoE on this machine: the baseline later RL steps are compared with.

Times mpo's path (megatron schedules + vocab-parallel chunked log-probs + backward) against a plain forward+backward
of the same GPTModel with torch.log_softmax, interleaved in one run so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench step", description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)

    from mpo.bench._util import init_single_rank

    ctx = init_single_rank()
    from mpo.models.builder import build_model
    from mpo.models.config import preset
    from mpo.models.forward import MicroBatch, run_microbatches

    cfg = preset(args.preset)
    model = build_model(cfg, ctx.parallel, ctx.device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(args.seq).expand(args.batch, args.seq)

    def mpo_step() -> None:
        run_microbatches(model, [MicroBatch(ids)], vocab_size=cfg.vocab_size,
                         loss_fn=lambda mb, lp, ent: (-lp.sum(), {}))

    def plain_step() -> None:
        logits = model(ids, positions, None)
        logp = torch.log_softmax(logits[..., : cfg.vocab_size].float(), -1)[:, :-1]
        (-logp.gather(-1, ids[:, 1:, None]).sum()).backward()

    timings: dict[str, list[float]] = {"mpo": [], "plain": []}
    for _ in range(3):
        mpo_step(), plain_step()
    for _ in range(args.repeats):
        for name, fn in (("mpo", mpo_step), ("plain", plain_step)):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in timings.items()}
    tokens = args.batch * args.seq
    print(f"tiny MoE fwd+bwd on {ctx.device.device} ({args.preset}, {args.batch}x{args.seq} tokens, "
          f"threads={torch.get_num_threads()}, median of {args.repeats})")
    print(f"  mpo step (schedules + chunked log-probs): {med['mpo']:.2f} ms  ({tokens / med['mpo'] * 1e3:.0f} tok/s)")
    print(f"  plain GPTModel + log_softmax:             {med['plain']:.2f} ms  ({tokens / med['plain'] * 1e3:.0f} tok/s)")
    print(f"  ratio mpo/plain: {med['mpo'] / med['plain']:.3f}")
    return 0
