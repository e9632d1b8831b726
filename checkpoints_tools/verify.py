"""verify: the HF model (transformers) and the converted megatron checkpoint (mpo, any layout) on the same prompts.

Reports max |logit diff|, max |log-prob diff| and, per MoE layer, the fraction of tokens whose top-k expert set is
identical. Megatron runs in freshly spawned gloo ranks (also for one rank), so the HF reference runs in a process
that never imported megatron's CPU shims; HF's rotary `inv_freq` is still checked against a fresh computation.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from checkpoints_tools.errors import ConversionError
from mpo.parallel.ports import free_port

DEFAULT_TOLERANCE = 1e-4


@dataclass
class VerifyReport:
    """Parity of HF and megatron on the same prompts.

    Attributes:
        layout: the megatron layout used (tp, ep, pp).
        max_logit_diff: max |logits_hf - logits_mcore| over prompts, positions and the real vocabulary.
        max_logprob_diff: max |log p_hf(token) - log p_mcore(token)| for the next-token log-probs.
        routing_agreement: per MoE layer, fraction of tokens with the same top-k expert set.
        tolerance: threshold on both diffs.
    """

    layout: dict
    max_logit_diff: float
    max_logprob_diff: float
    routing_agreement: dict[int, float] = field(default_factory=dict)
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def passed(self) -> bool:
        return (self.max_logit_diff <= self.tolerance and self.max_logprob_diff <= self.tolerance
                and all(a == 1.0 for a in self.routing_agreement.values()))

    def lines(self) -> list[str]:
        out = [f"layout {self.layout}",
               f"max |logit diff|   {self.max_logit_diff:.3e}",
               f"max |logprob diff| {self.max_logprob_diff:.3e}"]
        out += [f"layer {i:3d} top-k routing agreement {a:.4f}" for i, a in sorted(self.routing_agreement.items())]
        out.append(f"{'PASS' if self.passed else 'FAIL'} (tolerance {self.tolerance:g}, routing must agree exactly)")
        return out


def default_prompts(vocab_size: int, batch: int = 2, length: int = 16, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=gen).tolist()


def hf_reference(hf_dir: str | Path, prompts: list[list[int]]) -> dict:
    """Logits [b,s,V], next-token log-probs [b,s] (position 0 = 0) and per-layer sorted top-k [b*s,k] from HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    _check_rotary(model)
    routing: dict[int, torch.Tensor] = {}
    handles = []
    for index, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue

        def capture(_module, _inputs, output, index=index):
            routing[index] = torch.sort(output[2], dim=-1).values  # DSv3 uses topk(sorted=False)
        handles.append(gate.register_forward_hook(capture))
    ids = torch.tensor(prompts, dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits.float()
    for handle in handles:
        handle.remove()
    return {"logits": logits, "logprobs": next_token_logprobs(logits, ids), "routing": routing}


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[b,s] with position t holding log p(ids[t] | ids[<t]) and position 0 zero (mpo's convention)."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1).float()


def _check_rotary(model) -> None:
    rotary = getattr(model.model, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None or getattr(rotary, "rope_type", "default") != "default":
        return
    dim = inv_freq.numel() * 2
    base = model.config.rope_parameters.get("rope_theta", 10000.0) if getattr(model.config, "rope_parameters", None) \
        else getattr(model.config, "rope_theta", 10000.0)
    fresh = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not torch.allclose(inv_freq.float().cpu(), fresh, rtol=1e-6, atol=0):
        raise RuntimeError("HF rotary inv_freq is corrupted in this process; HF reference logits cannot be trusted")




def _rank_entry(rank: int, world: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from checkpoints_tools.mcore_runner import run_rank

    run_rank(*args)


def run_mcore(mcore_dir: str | Path, prompts: list[list[int]], *, tp: int = 1, ep: int = 1, pp: int = 1,
              etp: int | None = None, resave_dir: str | Path | None = None) -> dict:
    """Megatron outputs for the prompts at a layout, on the smallest world size that fits it."""
    import torch.multiprocessing as mp

    layout = dict(tensor_parallel=tp, expert_parallel=ep, pipeline_parallel=pp, expert_tensor_parallel=etp)
    expert_grid = (etp or tp) * ep * pp
    world = max(tp * pp, expert_grid)
    if world % (tp * pp) or world % expert_grid:
        raise ConversionError(f"layout tp={tp} ep={ep} pp={pp} etp={etp} has no common world size")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "mcore.pt")
        mp.start_processes(_rank_entry, args=(world, free_port(), (str(mcore_dir), prompts, layout, out_file, str(resave_dir) if resave_dir else None)),
                           nprocs=world, join=True, start_method="spawn")
        return torch.load(out_file, weights_only=True)


def compare(hf: dict, mcore: dict, layout: dict, tolerance: float = DEFAULT_TOLERANCE) -> VerifyReport:
    vocab = hf["logits"].shape[-1]
    logit_diff = (hf["logits"] - mcore["logits"][..., :vocab]).abs().max().item()
    logprob_diff = (hf["logprobs"][:, 1:] - mcore["logprobs"][:, 1:]).abs().max().item()
    agreement = {}
    for layer, hf_topk in hf["routing"].items():
        got = mcore["routing"].get(layer)
        if got is None or got.shape != hf_topk.shape:
            agreement[layer] = 0.0
        else:
            agreement[layer] = (got == hf_topk).all(-1).float().mean().item()
    for layer in mcore["routing"]:
        agreement.setdefault(layer, 0.0)  # megatron routes where HF does not: a mapping error
    return VerifyReport(layout, logit_diff, logprob_diff, agreement, tolerance)


def verify(hf_dir: str | Path, mcore_dir: str | Path, *, tp: int = 1, ep: int = 1, pp: int = 1,
           etp: int | None = None, prompts: list[list[int]] | None = None,
           tolerance: float = DEFAULT_TOLERANCE) -> VerifyReport:
    """Run both models on the same prompts and compare (see VerifyReport)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    prompts = prompts or default_prompts(config["vocab_size"])
    mcore = run_mcore(mcore_dir, prompts, tp=tp, ep=ep, pp=pp, etp=etp)
    hf = hf_reference(hf_dir, prompts)
    return compare(hf, mcore, dict(tp=tp, ep=ep, pp=pp, etp=etp), tolerance)
