"""Each megatron-core CPU shim is applied, makes its megatron call work, and is still needed (the call fails without
it). An upgrade that fixes a site upstream makes `fails_without` false here: then delete that shim."""

from __future__ import annotations

import json

import pytest

from helpers import shim_worker
from helpers.spawn import spawn_ranks
from mpo.parallel.cpu_shims import SHIMS, apply_cpu_shims


@pytest.fixture(scope="module")
def shim_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("shims") / "results.json"
    spawn_ranks(2, shim_worker.run, str(out))
    return json.loads(out.read_text())


def test_every_shim_has_a_scenario():
    assert set(shim_worker.SCENARIOS) == set(SHIMS)


@pytest.mark.parametrize("name", list(SHIMS))
def test_shim_applied_works_and_is_needed(name, shim_results):
    record = shim_results[name]
    assert record["applied"], f"{name} was not applied by initialize_parallel on CPU"
    assert record["works_with"], f"{name}: megatron call fails even with the shim:\n{record.get('error_with')}"
    assert record["fails_without"], f"{name}: megatron call works without the shim; it is no longer needed"
    assert record["restored"]


def test_shims_not_applied_when_cuda_present(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_cpu_shims() == []
    assert not any(shim.applied for shim in SHIMS.values())
