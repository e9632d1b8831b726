"""Every case of the second-wave golden file (algorithms_v2.json, float64 from an independent NumPy reference):
advantage estimators, the EMA baseline, DPPO losses, the clipped value loss, VAPO's positive NLL, rollout
corrections and corrected losses, each within 1e-10. The file comes from $MPO_GOLDEN_ALGOS, else the vendored
tests/golden/algorithms_v2.json.
"""

from __future__ import annotations

import pytest
import torch

from golden_data import load_golden_algos, t64

TOL = 1e-10
GOLDEN = load_golden_algos()


def _ids(section: str, key) -> list[str]:
    return [f"golden-{section}-{i:02d}-{key(c)}" for i, c in enumerate(GOLDEN[section])]


def _close(got: torch.Tensor, expected, what: str) -> None:
    exp = t64(expected)
    assert got.shape == exp.shape, (what, tuple(got.shape), tuple(exp.shape))
    err = (got.to(torch.float64) - exp).abs().max().item() if exp.numel() else 0.0
    assert err <= TOL, f"{what}: max abs error {err:.3e}"


@pytest.mark.parametrize("case", GOLDEN["advantage_cases"], ids=_ids("advantage_cases", lambda c: c["kind"]))
def test_golden_advantage_estimator(case):
    from mpo.algorithms import compute_advantages
    from mpo.algorithms.token_advantages import compute_token_advantages

    inputs, cfg, exp = case["inputs"], case["config"], case["expected"]
    rewards = t64(inputs["rewards"])
    if case["kind"] == "maxrl":
        out = compute_advantages(rewards, torch.tensor(inputs["group_ids"]), estimator="maxrl", eps=cfg["eps"])
        _close(out.advantages, exp["advantages"], "advantages")
        return
    kwargs = dict(cfg)
    if "group_ids" in inputs:
        kwargs["group_ids"] = torch.tensor(inputs["group_ids"])
    for key in ("values", "kl"):
        if key in inputs:
            kwargs[key] = t64(inputs[key])
    out = compute_token_advantages(case["kind"], rewards, t64(inputs["mask"]), **kwargs)
    _close(out.advantages, exp["advantages"], "advantages")
    if "returns" in exp:
        _close(out.returns, exp["returns"], "returns")
    if "lambda_policy" in exp:
        _close(out.lambda_policy, exp["lambda_policy"], "lambda_policy")


@pytest.mark.parametrize("case", GOLDEN["ema_cases"], ids=_ids("ema_cases", lambda c: c["kind"]))
def test_golden_ema_baseline(case):
    from mpo.algorithms.token_advantages import EMABaseline

    ema = EMABaseline(beta=case["config"]["beta"])
    for i, (batch, exp) in enumerate(zip(case["inputs"]["batches"], case["expected"], strict=True)):
        if i == 2:  # the baseline is trainer state: a restored copy continues exactly
            restored = EMABaseline()
            restored.load_state_dict(ema.state_dict())
            ema = restored
        adv, used = ema(t64(batch))
        assert abs(used - exp["baseline_used"]) <= TOL
        _close(adv, exp["advantages"], f"batch {i} advantages")
        assert abs(ema.baseline - exp["baseline_after"]) <= TOL


def _loss_and_grad(name: str, inputs: dict, config: dict, correction=None):
    from mpo.algorithms import PolicyBatch, compute_policy_loss, make_loss_config

    logp_new = t64(inputs["logp_new"]).requires_grad_(True)
    batch = PolicyBatch(logp_new=logp_new, logp_old=t64(inputs["logp_old"]), advantages=t64(inputs["advantages"]),
                        mask=t64(inputs["mask"]), group_ids=torch.tensor(inputs["group_ids"]),
                        logp_rollout=t64(inputs["logp_rollout"]) if "logp_rollout" in inputs else None)
    out = compute_policy_loss(name, batch, make_loss_config(name, **config), correction=correction)
    out.loss.backward()
    return out, logp_new.grad


@pytest.mark.parametrize("case", GOLDEN["loss_cases"], ids=_ids("loss_cases", lambda c: c["name"]))
def test_golden_dppo_loss(case):
    out, grad = _loss_and_grad(case["loss"], case["inputs"], case["config"])
    assert abs(out.loss.item() - case["expected"]["loss"]) <= TOL
    _close(grad, case["expected"]["grad_logp_new"], "grad_logp_new")
    for key, value in case["expected"]["metrics"].items():
        assert abs(out.metrics[key].item() - value) <= TOL, key


@pytest.mark.parametrize("case", GOLDEN["value_loss_cases"], ids=_ids("value_loss_cases", lambda c: c["config"]["agg"]))
def test_golden_value_loss(case):
    from mpo.algorithms import value_loss

    inputs = case["inputs"]
    values = t64(inputs["values_new"]).requires_grad_(True)
    loss, metrics = value_loss(values, t64(inputs["values_old"]), t64(inputs["returns"]), t64(inputs["mask"]),
                               clip=case["config"]["clip"], agg=case["config"]["agg"])
    loss.backward()
    assert abs(loss.item() - case["expected"]["loss"]) <= TOL
    _close(values.grad, case["expected"]["grad_values_new"], "grad_values_new")
    assert abs(metrics["vf_clipfrac"].item() - case["expected"]["clipfrac"]) <= TOL


@pytest.mark.parametrize("case", GOLDEN["nll_cases"], ids=_ids("nll_cases", lambda c: "vapo_positive_nll"))
def test_golden_positive_nll(case):
    from mpo.algorithms import positive_nll

    inputs = case["inputs"]
    logp = t64(inputs["logp_new"]).requires_grad_(True)
    loss, _ = positive_nll(logp, t64(inputs["mask"]), t64(inputs["rewards"]), **case["config"])
    loss.backward()
    assert abs(loss.item() - case["expected"]["loss"]) <= TOL
    _close(logp.grad, case["expected"]["grad_logp_new"], "grad_logp_new")


@pytest.mark.parametrize("case", GOLDEN["correction_cases"], ids=_ids("correction_cases", lambda c: c["kind"]))
def test_golden_rollout_correction(case):
    from mpo.algorithms import CorrectionConfig, apply_rollout_correction

    inputs = case["inputs"]
    out = apply_rollout_correction(t64(inputs["logp_old"]), t64(inputs["logp_rollout"]), t64(inputs["mask"]),
                                   CorrectionConfig(case["kind"], **case["config"]))
    _close(out.weights, case["expected"]["weights"], "weights")
    _close(out.mask_out, case["expected"]["mask_out"], "mask_out")
    for key, value in case["expected"]["metrics"].items():
        assert abs(out.metrics[key].item() - value) <= TOL, key


@pytest.mark.parametrize("case", GOLDEN["corrected_loss_cases"], ids=_ids("corrected_loss_cases", lambda c: c["name"]))
def test_golden_corrected_loss(case):
    from mpo.algorithms import CorrectionConfig

    correction = CorrectionConfig(case["correction"], **case["correction_config"])
    out, grad = _loss_and_grad(case["loss"], case["inputs"], case["config"], correction)
    assert abs(out.loss.item() - case["expected"]["loss"]) <= TOL
    _close(grad, case["expected"]["grad_logp_new"], "grad_logp_new")
    for key, value in case["expected"]["correction_metrics"].items():
        assert abs(out.metrics[f"rollout_{key}"].item() - value) <= TOL, key


def test_kl_k3_unbiased_matches_trls_bias_corrected_formula():
    """TRL GRPOTrainer with use_bias_correction_kl: per_token_kl = (exp(ref - logp) - (ref - logp) - 1) * exp(logp -
    old_logp), token-mean here; written out independently in float64, value and gradient."""
    from mpo.algorithms import kl_penalty

    gen = torch.Generator().manual_seed(5)
    logp = (-torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    ref = logp.detach() + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    old = logp.detach() + 0.2 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).to(torch.float64)
    loss, _ = kl_penalty(logp, ref, mask, "k3_unbiased", "token-mean", logp_old=old)
    (grad,) = torch.autograd.grad(loss, logp)
    x = logp.detach().clone().requires_grad_(True)
    trl = (torch.exp(ref - x) - (ref - x) - 1) * torch.exp(x - old)
    expected = (trl * mask).sum() / mask.sum()
    (expected_grad,) = torch.autograd.grad(expected, x)
    assert abs(loss.item() - expected.item()) <= TOL
    assert (grad - expected_grad).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="needs logp_old"):
        kl_penalty(logp, ref, mask, "k3_unbiased")
