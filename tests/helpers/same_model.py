"""Two builds of one model (mpo's and a reference from megatron's own classes, same weights) compared bit for bit."""

from __future__ import annotations

import torch


def assert_bit_identical(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor) -> dict:
    """Forward `ids` through both models and back-propagate a loss that reaches every weight through the
    (vocab-parallel) logits, as training's log-probs do; logits and every gradient must be equal bit for bit.
    Returns mpo's gradients by parameter name (for further checks)."""
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    results = []
    for net in (model, reference):
        logits = net(ids, positions, None)
        logits.float().logsumexp(-1).sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}))
    (logits, grads), (ref_logits, ref_grads) = results
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[name], ref_grads[name]) for name in grads), \
        [name for name in grads if not torch.equal(grads[name], ref_grads[name])]
    return grads
