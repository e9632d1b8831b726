"""Where an RL step's time goes: the demo config run by mpo (torchrun, gloo ranks, mpo's engine over HTTP) with
`logging.phase_times` on, phase by phase, against an in-process reference doing the same work in one process.

mpo: `mpo demo --steps N` (eval and intermediate checkpoints off), each step's `time/<phase>_s` from metrics.jsonl
(rank 0's clock, mpo.trainer.phases), averaged over the steps after the first (step 0 pays warm-up). Seconds per
step = the mean of `schedule/step_s` (end of one step to the end of the next: everything a step costs).

Reference: the same model (the demo's preset as HF transformers' Qwen3-MoE, random weights: the work, not the
answers, is what is timed) as a plain PyTorch module in this process, doing per step what the demo does: the same
prompts (the toy task's draw), sampled generation with a KV cache (HF `generate`), scoring with the task's reward,
group-normalised advantages, an old-logprob forward, then `schedule.updates_per_step` updates of PPO's clipped token
loss over micro-batches of `schedule.micro_batch_size`, each closed by the gradient-norm clip at `schedule.clip_grad`
(as the demo's optimizer clips) and an Adam step. Same thread count as the demo's
processes together (torch.set_num_threads(--threads)). It runs before mpo's command and again after it; its seconds
per step are the mean of the two runs (both printed).

Last line: `step-profile mpo_s_per_step=<a> reference_s_per_step=<b> ratio=<a/b>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

# The order the phase table prints in; indented ones are parts of the phase above them.
PHASES = (("collect", 0), ("prompt_draw", 1), ("request_build", 1), ("engine", 1), ("http_and_decode", 1),
          ("scoring", 1), ("broadcast", 0), ("microbatch_build", 0), ("old_logprob_pass", 0), ("update0", 0),
          ("update1", 0), ("forward_backward", 1), ("optimizer", 1), ("metrics_gather", 0), ("sync", 0),
          ("metrics_write", 0), ("checkpoint", 0), ("eval", 0))


def run_mpo(steps: int, overrides: list[str], work: Path) -> tuple[float, dict[str, float], float]:
    """(seconds per RL step, mean seconds per phase, wall time of the whole command)."""
    from mpo.bench._util import run_demo

    rows, wall = run_demo(work / "demo", steps, ["logging.phase_times=true", *overrides], work / "demo.log",
                          "step_profile")
    rows = rows[1:]  # RL steps after the first
    if not rows:
        raise SystemExit("step_profile: --steps must be at least 2 (step 0 is not counted)")
    phases = {name: statistics.fmean(r.get(f"time/{name}_s", 0.0) for r in rows) for name, _ in PHASES}
    return statistics.fmean(r["schedule/step_s"] for r in rows), phases, wall


def run_reference(steps: int, overrides: list[str], threads: int) -> tuple[float, dict[str, float]]:
    """(seconds per step, mean seconds per phase) of the in-process reference (steps after the first)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mpo.config import RECIPES
    from mpo.config_checks import load_config, model_config
    from mpo.models.config import to_hf_config
    from mpo.trainer.tasks import make_task

    torch.set_num_threads(threads)
    config = load_config(RECIPES / "demo_cpu.yaml", overrides)
    cfg, rollout, sched = model_config(config), config.rollout, config.schedule
    torch.manual_seed(config.seed)
    hf = {k: v for k, v in to_hf_config(cfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).float()
    optimizer = torch.optim.Adam(model.parameters(), lr=sched.lr, foreach=True)
    task = make_task(config)
    G, clip = rollout.samples_per_prompt, 0.2
    budget = min(rollout.max_new_tokens, task.max_answer_tokens or rollout.max_new_tokens)
    eos = task.stop_token_ids[0]

    def token_logprobs(ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    times: list[float] = []
    phase_rows: list[dict[str, float]] = []
    for step in range(steps):
        phase: dict[str, float] = {}
        began = time.perf_counter()
        prompts = task.draw(step, config.data.prompts_per_step)
        width = max(len(p.ids) for p in prompts)  # left-padded for generate
        ids = torch.tensor([[eos] * (width - len(p.ids)) + list(p.ids) for p in prompts for _ in range(G)])
        attention = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts for _ in range(G)])
        t = time.perf_counter()
        with torch.no_grad():
            full = model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=rollout.temperature,
                                  top_k=0, top_p=1.0, max_new_tokens=budget, eos_token_id=eos, pad_token_id=eos,
                                  use_cache=True)
        phase["generate"] = time.perf_counter() - t
        t = time.perf_counter()
        outputs = [row[: row.index(eos) + 1] if eos in row else row for row in full[:, width:].tolist()]
        rewards = torch.tensor(task.score([p for p in prompts for _ in range(G)], outputs).rewards)
        grouped = rewards.view(-1, G)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        phase["scoring"] = time.perf_counter() - t
        # Loss mask: the response's tokens up to and including its EOS (what generate padded after it is not)
        response = torch.zeros_like(full, dtype=torch.bool)
        for i, out in enumerate(outputs):
            response[i, width : width + len(out)] = True
        mask = response[:, 1:].float()
        attention_full = torch.cat([attention, response[:, width:].long()], 1)
        t = time.perf_counter()
        with torch.no_grad():
            old = torch.cat([token_logprobs(full[i : i + sched.micro_batch_size],
                                            attention_full[i : i + sched.micro_batch_size])
                             for i in range(0, len(full), sched.micro_batch_size)])
        phase["old_logprob_pass"] = time.perf_counter() - t
        t = time.perf_counter()
        for u in range(sched.updates_per_step):
            rows = torch.arange(u, len(full), sched.updates_per_step)
            optimizer.zero_grad(set_to_none=True)
            tokens = mask[rows].sum()
            for chunk in rows.split(sched.micro_batch_size):
                new = token_logprobs(full[chunk], attention_full[chunk])
                ratio = torch.exp(new - old[chunk])
                adv = advantages[chunk, None]
                loss = -(torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv) * mask[chunk]).sum() / tokens
                loss.backward()
            if sched.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), sched.clip_grad, foreach=True)
            optimizer.step()
        phase["updates"] = time.perf_counter() - t
        times.append(time.perf_counter() - began)
        phase_rows.append(phase)
    return statistics.fmean(times[1:]), {k: statistics.fmean(r[k] for r in phase_rows[1:]) for k in phase_rows[0]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpo.bench step_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="RL steps of each side (the first is not counted)")
    parser.add_argument("--threads", type=int, default=2, help="the reference's torch threads (the machine's cores)")
    parser.add_argument("overrides", nargs="*", help="section.field=value for the demo config (both sides)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 0 is not counted)")
    # The reference runs once before mpo's command and once after it, and counts as their mean: a shared machine's
    # speed drifts, and one reference run alone moved the ratio by as much as what this bench measures.
    before = run_reference(args.steps, args.overrides, args.threads)
    with tempfile.TemporaryDirectory(prefix="mpo-step-profile-") as tmp:
        mpo_s, phases, wall = run_mpo(args.steps, args.overrides, Path(tmp))
    after = run_reference(args.steps, args.overrides, args.threads)
    ref_s = (before[0] + after[0]) / 2
    ref_phases = {name: (before[1][name] + after[1][name]) / 2 for name in before[1]}
    print(f"demo config, {args.steps} RL steps each (the first not counted); mpo's command took {wall:.1f} s in all "
          f"(start-up and warm start included)")
    print(f"{'mpo phase (rank 0)':28s}{'s/step':>9s}{'share':>8s}")
    for name, depth in PHASES:
        if phases[name] > 0:
            print(f"{'  ' * depth + name:28s}{phases[name]:9.4f}{phases[name] / mpo_s:8.1%}")
    accounted = sum(phases[name] for name, depth in PHASES if depth == 0)
    print(f"{'(not in a phase)':28s}{mpo_s - accounted:9.4f}{(mpo_s - accounted) / mpo_s:8.1%}")
    print(f"{'mpo step (schedule/step_s)':28s}{mpo_s:9.4f}")
    print(f"{'reference phase':28s}{'s/step':>9s}")
    for name, seconds in ref_phases.items():
        print(f"{name:28s}{seconds:9.4f}")
    print(f"{'reference step':28s}{ref_s:9.4f}  (before mpo's run {before[0]:.4f}, after it {after[0]:.4f})")
    print(f"step-profile mpo_s_per_step={mpo_s:.4f} reference_s_per_step={ref_s:.4f} ratio={mpo_s / ref_s:.2f}")
    return 0
