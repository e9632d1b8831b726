"""The LM head fused with the log-probs (mpo.models.fused_head) gives the numbers of whole logits without ever holding
them: against float64 torch.log_softmax of hidden @ weight.T (values and the hidden / weight gradients, padded vocab,
odd chunks, TP2 over gloo), and through megatron-core's schedule on a real model against the whole-logits path that
the golden and layout tests pin (log-probs, entropy, loss and every parameter's gradient at TP1 and TP2, fp32 and
bf16 with the FP32 head, tied embeddings)."""

from __future__ import annotations

import pytest
import torch

from helpers import fused_head_worker
from helpers.spawn import spawn_ranks
from mpo.models.fused_head import fused_head_logprobs
from mpo.models.logprobs import sequence_logprobs, vocab_parallel_logprobs

VOCAB, PADDED, HIDDEN = 61, 64, 24


def _problem(seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 9, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64) / 2
    labels = torch.randint(0, VOCAB, (3, 9), generator=gen)
    w_logp = torch.randn(3, 9, generator=gen, dtype=torch.float64)
    w_ent = torch.randn(3, 9, generator=gen, dtype=torch.float64)
    return hidden, weight, labels, w_logp, w_ent


def _reference(hidden, weight, labels):
    """Plain autograd through float64 log_softmax of the whole logits (shares no code with mpo)."""
    logsm = torch.log_softmax((hidden @ weight.t())[..., :VOCAB], dim=-1)
    return logsm.gather(-1, labels[..., None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


def _grads(fn, hidden, weight, labels, w_logp, w_ent):
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, ent = fn(hidden, weight, labels)
    g_h, g_w = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum(), (hidden, weight))
    return logp.detach(), ent.detach(), g_h, g_w


@pytest.mark.parametrize("chunk_tokens", [1, 5, 1000])
def test_fused_head_equals_float64_log_softmax_of_whole_logits(chunk_tokens):
    hidden, weight, labels, w_logp, w_ent = _problem()
    fused = _grads(lambda h, w, y: fused_head_logprobs(h, w, y, vocab_size=VOCAB, chunk_tokens=chunk_tokens),
                   hidden, weight, labels, w_logp, w_ent)
    reference = _grads(_reference, hidden, weight, labels, w_logp, w_ent)
    for got, want in zip(fused, reference):
        assert (got - want).abs().max() < 1e-12
    assert fused[3][VOCAB:].abs().max() == 0  # padded vocabulary rows of the head get no gradient


def test_fused_head_fp32_equals_unfused_fp32_path_within_1e6():
    hidden, weight, labels, w_logp, w_ent = _problem(seed=8)
    hidden, weight = hidden * 3, weight * 2  # confident logits, where fp32 rounding shows

    def unfused(h, w, y):
        return sequence_logprobs(h @ w.t(), y, vocab_size=VOCAB)

    def fused(h, w, y):
        return sequence_logprobs(h, y, vocab_size=VOCAB, head_weight=w, chunk_tokens=4)

    got = _grads(fused, hidden.float(), weight.float(), labels, w_logp.float(), w_ent.float())
    want = _grads(unfused, hidden.float(), weight.float(), labels, w_logp.float(), w_ent.float())
    exact = _grads(unfused, hidden, weight, labels, w_logp, w_ent)
    for g, w, e in zip(got, want, exact):
        scale = max(1.0, e.abs().max().item())
        assert (g.double() - w.double()).abs().max() / scale < 1e-6
        assert (g.double() - e).abs().max() / scale < 1e-5  # both near float64


def _tp2_body(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hidden, weight, labels, w_logp, w_ent = _problem()
    local_w = weight.chunk(2, dim=0)[rank].clone().requires_grad_(True)
    hidden = hidden.clone().requires_grad_(True)
    logp, ent = fused_head_logprobs(hidden, local_w, labels, vocab_size=VOCAB, tp_group=dist.group.WORLD,
                                    chunk_tokens=4)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    torch.save({"logp": logp.detach(), "entropy": ent.detach(), "grad_hidden": hidden.grad, "grad_w": local_w.grad},
               f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_fused_head_vocab_parallel_tp2_equals_float64_reference(tmp_path):
    spawn_ranks(2, _tp2_body, str(tmp_path))
    hidden, weight, labels, w_logp, w_ent = _problem()
    ref_logp, ref_ent, ref_gh, ref_gw = _grads(_reference, hidden, weight, labels, w_logp, w_ent)
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for part in parts:
        assert (part["logp"] - ref_logp).abs().max() < 1e-12 and (part["entropy"] - ref_ent).abs().max() < 1e-12
    # each rank's hidden gradient is its vocab slice's share; the TP all-reduce (megatron's copy region) sums them
    assert (parts[0]["grad_hidden"] + parts[1]["grad_hidden"] - ref_gh).abs().max() < 1e-12
    assert (torch.cat([p["grad_w"] for p in parts]) - ref_gw).abs().max() < 1e-12


@pytest.mark.parametrize("layout,dtype,tied", [
    ({}, "fp32", False),
    ({}, "bf16", True),
    ({"tensor_parallel": 2}, "fp32", False),
    ({"tensor_parallel": 2}, "bf16", False),
], ids=["tp1-fp32", "tp1-bf16-fp32head-tied", "tp2-fp32", "tp2-bf16-fp32head"])
def test_fused_head_through_megatron_equals_whole_logits(tmp_path, layout, dtype, tied):
    world = layout.get("tensor_parallel", 1)
    spawn_ranks(world, fused_head_worker.run, str(tmp_path), layout, dtype, tied)
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        whole, fused = res["whole"], res["fused"]
        for key in ("logprobs", "entropy", "loss"):
            assert (fused[key] - whole[key]).abs().max() < 1e-6, key
        assert whole["grads"].keys() == fused["grads"].keys() and len(whole["grads"]) > 5
        # bf16 parameters' gradients are rounded to bf16 (2^-8 relative); the fp32 ones must agree to 1e-6
        for name, g in whole["grads"].items():
            f = fused["grads"][name]
            tol = 1e-6 if dtype == "fp32" or "output_layer" in name else 1e-2
            assert (f - g).abs().max() <= tol * max(1.0, g.abs().max().item()), name


def test_fused_head_never_makes_a_tokens_by_vocab_tensor():
    """Every tensor any op makes during the fused head's forward and backward (seen by a dispatch mode) is at most one
    chunk of logits; the whole-logits path makes [tokens, vocab] ones (so the watcher can see them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    tokens, vocab, hidden, chunk = 512, 4096, 16, 32
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_(True)
    w = torch.randn(vocab, hidden, generator=gen).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    sizes = {}
    for name in ("fused", "whole"):
        with Largest() as watch:
            if name == "fused":
                logp, ent = fused_head_logprobs(h, w, labels, vocab_size=vocab, chunk_tokens=chunk)
            else:
                logp, ent = vocab_parallel_logprobs(h @ w.t(), labels, vocab_size=vocab)
            (logp.sum() + ent.sum()).backward()
        sizes[name] = watch.numel
    assert sizes["whole"] >= tokens * vocab
    assert sizes["fused"] <= max(chunk * vocab, vocab * hidden)  # one chunk of logits, or the weight's gradient


def test_fused_head_leaves_the_model_as_it_was(tmp_path):
    """After fused passes the model's parameters and state_dict keys are the same as before (the deferred layer keeps
    the weight it used outside the module) and its output layer gives logits again."""
    spawn_ranks(1, fused_head_worker.run_state, str(tmp_path))
    assert (tmp_path / "ok").read_text() == "ok"
