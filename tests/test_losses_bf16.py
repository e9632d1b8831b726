"""bf16 model: every registered loss is finite and one gradient step raises the logp of a positive-advantage token."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpo.algorithms import PolicyBatch, compute_policy_loss, loss_names, make_loss_config

VOCAB, HIDDEN, B, T, LAYERS, TOPK = 32, 16, 3, 6, 2, 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def token_logp(self, tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens[:, t+1] | tokens[:, t]) in bf16, shape [B, T]."""
        logits = self.head(self.embed(tokens[:, :-1]))
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("name", loss_names(), ids=[f"bf16-{n}" for n in loss_names()])
def test_bf16_positive_advantage_token_goes_up(name):
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (B, T + 1))
    mask = torch.zeros(B, T)
    mask[0, 2] = 1.0  # the only valid token has A > 0
    advantages = torch.where(mask.bool(), 1.0, 0.0)
    router_old = torch.log_softmax(torch.randn(B, T, LAYERS, 8), -1)[..., :TOPK]
    router_new = router_old + 0.01 * torch.randn_like(router_old)

    logp = model.token_logp(tokens)
    assert logp.dtype == torch.bfloat16
    cfg = make_loss_config(name, norm_const=T)  # only seq-mean-token-sum-norm (drgrpo) uses it
    batch = PolicyBatch(logp, logp.detach(), advantages, mask, group_ids=torch.arange(B),
                        router_logp_new=router_new, router_logp_old=router_old)
    out = compute_policy_loss(name, batch, cfg)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)

    with torch.no_grad():
        before = model.token_logp(tokens)[0, 2].float()
        for p in model.parameters():
            p -= 1.0 * p.grad
        after = model.token_logp(tokens)[0, 2].float()
    assert after > before, f"{name}: logp of the A>0 token went {before:.4f} -> {after:.4f}"
