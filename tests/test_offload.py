"""rollout.colocate's trainer side (mpo.trainer.offload) on real megatron-core and gloo (2 ranks, EP2): every storage
of the model, gradients and optimizer is freed while offloaded and bit-exact after the reload, training goes on as
if nothing happened, and the colocated loop's losses equal a non-colocated run's."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import offload_worker
from helpers.spawn import spawn_ranks
from mpo.trainer.offload import TrainerOffload, offload_enabled

VARIANTS = {
    # megatron's Float16OptimizerWithFloat16Params: fp32 main params next to bf16 model params (the head stays fp32)
    "bf16": (False, ["model.dtype=bf16"]),
    # the DistributedOptimizer (param_data buffers, sharded state) with a critic (its own DDP and optimizer) and the
    # KL reference weights
    "distributed+critic+kl": (True, ["algorithm.advantage=gae", "algorithm.filter_zero_variance=false",
                                     "algorithm.kl_coef=0.01"]),
}
LOOP_STEPS = 3
LOOP = ["schedule.sft_steps=2", "data.prompts_per_step=4", "logging.checkpoint_every=0"]
TIMING = ("_s", "_per_s", "engine_busy_frac", "overlap_frac")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    spawn_ranks(2, offload_worker.run, str(out), VARIANTS, LOOP_STEPS, LOOP)
    loop = {c: [json.loads(line) for line in (out / f"colocate_{c}" / "metrics.jsonl").read_text().splitlines()]
            for c in ("false", "true")}
    return json.loads((out / "offload.json").read_text()), loop


def _closed_form_bytes(variant: dict) -> int:
    """The plain optimizer's bytes from the parameter count alone: each parameter, its fp32 grad, an fp32 main copy
    when it is not fp32, Adam's two fp32 moments; plus one 4-byte `step` per parameter tensor (torch Adam)."""
    sizes = {int(size): n for size, n in variant["numel_by_size"].items()}  # JSON made the keys strings
    return sum(n * (size + 4 + (4 if size != 4 else 0) + 8) for size, n in sizes.items()) \
        + 4 * variant["param_tensors"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_offload_frees_every_storage_and_reload_is_bit_exact(runs, name):
    for rank, results in enumerate(runs[0]):
        v = results[name]
        assert v["held"] > 50 and set(v["state_keys"]) == {"exp_avg", "exp_avg_sq", "step"}
        for cycle in v["cycles"]:  # two cycles: the second reuses the host buffers
            assert cycle["resident_while_offloaded"] == [], f"rank {rank}"
            assert cycle["metrics"]["offload/bytes"] == v["expected_bytes"]
            assert 0 < cycle["metrics"]["offload/host_bytes"] < v["expected_bytes"]  # grads are not copied
            assert cycle["differ_after_reload"] == [] and cycle["nonzero_grads_after_reload"] == []
            assert "offload() called twice" in cycle["offload_twice"]
        assert "reload() without a preceding offload()" in v["reload_twice"]
        # training after the round trips equals training without them, bit for bit
        assert v["losses"] == v["twin_losses"] and v["params_differ_from_twin"] == 0


def test_plain_optimizer_bytes_match_the_parameter_count(runs):
    for results in runs[0]:
        v = results["bf16"]
        assert v["optimizers"] == ["Float16OptimizerWithFloat16Params"]
        assert v["expected_bytes"] == _closed_form_bytes(v)


def test_distributed_variant_holds_what_it_should(runs):
    for results in runs[0]:
        v = results["distributed+critic+kl"]
        assert v["optimizers"] == ["DistributedOptimizer"] and v["has_critic"] and v["has_reference"]
        assert v["by_kind"]["extra"] > 0  # the KL reference weights


def test_colocated_loop_equals_resident_loop(runs):
    """Same seed, same engine: the colocated run (engines release and resume, the trainer offloads and reloads every
    step) logs exactly the metrics of the resident run, timings and its own offload metrics aside."""
    resident, colocated = runs[1]["false"], runs[1]["true"]
    assert [r["step"] for r in colocated] == list(range(LOOP_STEPS))
    for want, have in zip(resident, colocated):
        assert have["offload/bytes"] > 0 and have["offload/host_bytes"] > 0
        assert have["offload/offload_s"] >= 0 and have["offload/reload_s"] >= 0
        same = lambda row: {k: v for k, v in row.items()  # noqa: E731
                            if not k.startswith("offload/") and not k.endswith(TIMING)}
        assert same(have) == same(want), f"step {want['step']}"
        assert "offload/bytes" not in want
    assert any(r.get("grad_norm", 0) > 0 for r in colocated)  # the steps trained


def test_protocol_on_a_bare_module_and_torch_adam():
    """No megatron: a Linear whose weight and a view of it share one storage, torch Adam after one step. Bytes from
    the shapes: weight 4x3 and bias 4 (fp32) are 64 bytes, their grads 64, Adam's moments 128, two 4-byte steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    row = model.weight.data[1]  # a view: the same storage, counted once, valid again after the reload
    offload = TrainerOffload([model], [optimizer], device=torch.device("cpu"), extra=[row])
    offload.offload()  # before the first step: no gradients, no Adam state yet
    assert offload.bytes_by_kind() == {"model": 64, "grad": 0, "optimizer": 0, "extra": 0}
    offload.reload()
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()  # Adam makes its state now: the next offload finds it
    tensors = [model.weight, model.bias, model.weight.grad, model.bias.grad,
               *[v for state in optimizer.state.values() for v in state.values()]]
    before = [t.detach().clone() for t in tensors]
    offload.offload()
    assert all(t.untyped_storage().size() == 0 for t in [*tensors, row])
    assert offload.metrics()["offload/bytes"] == 64 + 64 + 128 + 8
    assert offload.metrics()["offload/host_bytes"] == 64 + 128 + 8  # gradients are not copied
    assert offload.bytes_by_kind() == {"model": 64, "grad": 64, "optimizer": 136, "extra": 0}
    with pytest.raises(RuntimeError, match="offload\\(\\) called twice"):
        offload.offload()
    offload.reload()
    for t, want in zip(tensors, before):
        assert torch.equal(t, torch.zeros_like(want) if t is model.weight.grad or t is model.bias.grad else want)
    assert torch.equal(row, before[0][1])
    with pytest.raises(RuntimeError, match="reload\\(\\) without a preceding offload\\(\\)"):
        offload.reload()


def test_offload_trainer_switch():
    from mpo.config import RECIPES
    from mpo.config import ConfigError
    from mpo.config_checks import load_config

    def enabled(*overrides: str) -> bool:
        return offload_enabled(load_config(RECIPES / "demo_cpu.yaml", list(overrides)).rollout)

    assert enabled("rollout.colocate=true") and not enabled()
    assert not enabled("rollout.colocate=true", "rollout.offload_trainer=false")
    with pytest.raises(ConfigError, match="rollout.offload_trainer=true needs rollout.colocate=true"):
        enabled("rollout.offload_trainer=true")
