"""Every case of the golden file: loss, autograd dL/dlogp_new, token weights and every metric within 1e-10 (fp64).

Cases are parametrised from the file at collection time, so new cases need no code change. The file comes from
$MPO_GOLDEN_LOSSES, else the vendored tests/golden/losses.json.
"""

from __future__ import annotations

import pytest
import torch

from golden_data import GOLDEN_LOSS_ALIASES, case_id, golden_section, t64
from mpo.algorithms import (
    PolicyBatch,
    RouterShift,
    compute_advantages,
    compute_global_denominators,
    compute_policy_loss,
    gamma_from_router_logits,
    get_loss,
    kl_penalty,
    make_loss_config,
    router_logp_at_old_topk,
    token_weights,
)

TOL = 1e-10


def assert_close(actual: torch.Tensor, expected, what: str) -> None:
    expected = t64(expected)
    actual = actual.detach().to(torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= TOL, f"{what}: max abs error {err:.3e} > {TOL:g}\nactual={actual}\nexpected={expected}"


def assert_metrics(actual: dict[str, torch.Tensor], expected: dict[str, float]) -> None:
    missing = sorted(set(expected) - set(actual))
    assert not missing, f"golden metrics with no counterpart in the implementation: {missing}"
    for name, value in expected.items():
        assert_close(actual[name], value, f"metric {name}")


def registry_name(case: dict) -> str:
    name = GOLDEN_LOSS_ALIASES.get(case["loss"], case["loss"])
    has_router_input = any(k in case["inputs"] for k in ("log_gamma", "router_logp_new"))
    if has_router_input and not get_loss(name).router_shift:
        name += "+rs"
    return name


LOSS_CASES = golden_section("cases")


@pytest.mark.parametrize("case", LOSS_CASES, ids=[case_id("loss", i, c["name"]) for i, c in enumerate(LOSS_CASES)])
def test_golden_loss_case(case):
    inp, exp = case["inputs"], case["expected"]
    logp_new = t64(inp["logp_new"]).requires_grad_(True)
    batch = PolicyBatch(
        logp_new=logp_new,
        logp_old=t64(inp["logp_old"]),
        advantages=t64(inp["advantages"]),
        mask=t64(inp["mask"]),
        group_ids=torch.tensor(inp["group_ids"], dtype=torch.long),
        router_logp_new=t64(inp["router_logp_new"]) if "router_logp_new" in inp else None,
        router_logp_old=t64(inp["router_logp_old"]) if "router_logp_old" in inp else None,
        router_shift=RouterShift(log_gamma=t64(inp["log_gamma"])) if "log_gamma" in inp else None,
    )
    name = registry_name(case)
    cfg = make_loss_config(name, **case["config"])
    out = compute_policy_loss(name, batch, cfg)
    out.loss.backward()

    assert_close(out.loss, exp["loss"], "loss")
    assert_close(logp_new.grad, exp["grad_logp_new"], "dL/dlogp_new")
    assert torch.all(logp_new.grad[batch.mask == 0] == 0), "gradient leaks into masked positions"
    denoms = compute_global_denominators(batch.mask, batch.group_ids, batch.advantages)
    assert_close(token_weights(batch.mask, cfg.agg, denoms, batch.group_ids, cfg.norm_const),
                 exp["token_weights"], "token_weights")
    assert_metrics(out.metrics, exp["metrics"])


ADV_CASES = golden_section("advantage_cases")


@pytest.mark.parametrize(
    "case", ADV_CASES,
    ids=[case_id("adv", i, f"{c['kind']}-{c['singleton']}-eps{c['eps']:g}") for i, c in enumerate(ADV_CASES)])
def test_golden_advantage_case(case):
    out = compute_advantages(t64(case["rewards"]), torch.tensor(case["group_ids"]), case["kind"], case["eps"],
                             case["singleton"])
    assert_close(out.advantages, case["expected"], "advantages")


KL_CASES = golden_section("kl_cases")


@pytest.mark.parametrize("case", KL_CASES,
                         ids=[case_id("kl", i, f"{c['kind']}-{c['agg']}") for i, c in enumerate(KL_CASES)])
def test_golden_kl_case(case):
    inp, exp = case["inputs"], case["expected"]
    logp_new = t64(inp["logp_new"]).requires_grad_(True)
    mask = t64(inp["mask"])
    loss, metrics = kl_penalty(logp_new, t64(inp["logp_ref"]), mask, case["kind"], case["agg"],
                               norm_const=case.get("norm_const"))
    loss.backward()
    assert_close(loss, exp["loss"], "kl loss")
    assert_close(logp_new.grad, exp["grad_logp_new"], "dKL/dlogp_new")
    assert torch.all(logp_new.grad[mask == 0] == 0)
    assert_metrics(metrics, exp["metrics"])


GAMMA_CASES = golden_section("gamma_cases")


@pytest.mark.parametrize("case", GAMMA_CASES,
                         ids=[case_id("gamma", i, f"top{c['topk']}-min{c['gamma_min']:g}") for i, c in
                              enumerate(GAMMA_CASES)])
def test_golden_gamma_case(case):
    inp, exp = case["inputs"], case["expected"]
    old, new = t64(inp["router_logits_old"]), t64(inp["router_logits_new"])
    idx, old_sel, new_sel = router_logp_at_old_topk(old, new, case["topk"])
    assert torch.equal(idx, torch.tensor(exp["topk_indices_old"])), "old top-K experts differ"
    assert_close(old_sel, exp["router_logp_old_sel"], "router_logp_old_sel")
    assert_close(new_sel, exp["router_logp_new_sel"], "router_logp_new_sel")
    shift = gamma_from_router_logits(old, new, case["topk"], case["gamma_min"])
    assert_close(shift.gamma_raw, exp["gamma_raw"], "gamma_raw")
    assert_close(shift.log_gamma.exp(), exp["gamma"], "gamma")
    assert_close(shift.abs_logdiff, exp["mean_abs_logdiff"], "mean_abs_logdiff")
