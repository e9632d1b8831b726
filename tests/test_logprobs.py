"""Token log-probs and entropies from vocab-parallel logits equal torch.log_softmax on the gathered logits (and their
gradients equal autograd through it), with the padded vocabulary excluded, chunking, and t-1 alignment."""

from __future__ import annotations

import pytest
import torch

from helpers import logprob_worker
from helpers.spawn import spawn_ranks
from mpo.models.logprobs import sequence_logprobs, vocab_parallel_logprobs


def _reference(logits, labels, vocab_size):
    logsm = torch.log_softmax(logits[..., :vocab_size], dim=-1)
    return logsm.gather(-1, labels[..., None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 1000])
def test_matches_log_softmax_single_rank(chunk_tokens):
    logits, labels, w_logp, w_ent = logprob_worker.global_problem()
    logits.requires_grad_(True)
    logp, ent = vocab_parallel_logprobs(logits, labels, vocab_size=61, chunk_tokens=chunk_tokens)
    ref_logp, ref_ent = _reference(logits, labels, 61)
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    grad = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum(), logits)[0]
    ref_grad = torch.autograd.grad((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum(), logits)[0]
    assert torch.allclose(grad, ref_grad, atol=1e-12)
    assert grad[..., 61:].abs().max() == 0  # padded vocab entries get no gradient


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_gathered_log_softmax(world, tmp_path):
    spawn_ranks(world, logprob_worker.run, str(tmp_path))
    logits, labels, w_logp, w_ent = logprob_worker.global_problem()
    logits.requires_grad_(True)
    ref_logp, ref_ent = _reference(logits, labels, 61)
    ref_grad = torch.autograd.grad((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum(), logits)[0]
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for part in parts:  # every rank ends with the full per-token results
        assert (part["logp"] - ref_logp).abs().max() < 1e-12
        assert (part["entropy"] - ref_ent).abs().max() < 1e-12
    grad = torch.cat([p["grad"] for p in parts], dim=-1)
    assert (grad - ref_grad).abs().max() < 1e-12


def test_bf16_logits_are_scored_in_fp32():
    logits, labels, _, _ = logprob_worker.global_problem()
    logp, _ = vocab_parallel_logprobs(logits.bfloat16(), labels, vocab_size=61)
    ref, _ = _reference(logits.bfloat16().double(), labels, 61)
    assert logp.dtype == torch.float32 and (logp.double() - ref).abs().max() < 1e-5


def test_sequence_alignment_padding_and_packing():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 10, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 10, (2, 6), generator=gen)
    logp, _ = sequence_logprobs(logits, ids, vocab_size=10)
    logsm = torch.log_softmax(logits, -1)
    assert logp[:, 0].abs().max() == 0
    for t in range(1, 6):  # token t is scored by the logits at position t-1
        assert torch.allclose(logp[:, t], logsm[:, t - 1].gather(-1, ids[:, t : t + 1]).squeeze(-1))
    # Row 1 packs two sequences (positions restart at 3): the second's first token has no prediction.
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])
    packed, _ = sequence_logprobs(logits, ids, vocab_size=10, position_ids=positions)
    assert packed[1, 3] == 0 and packed[1, 0] == 0
    assert torch.equal(packed[0], logp[0]) and torch.equal(packed[1, [1, 2, 4, 5]], logp[1, [1, 2, 4, 5]])


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long), vocab_size=8)
