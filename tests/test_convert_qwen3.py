"""Qwen3-MoE: HF -> torch_dist -> megatron-core at several layouts matches transformers; torch_dist -> HF is exact.

References are independent of the converter: transformers' own forward (logits and router top-k via hooks), the
original safetensors files, and megatron-core's own dist_checkpointing.save / gather_full_state.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from checkpoints_tools import hf_to_mcore, mapping_for, mcore_to_hf, model_config_from_hf
from checkpoints_tools.cli import main as cli_main
from checkpoints_tools.torch_dist_io import TorchDistReader
from checkpoints_tools.verify import compare, default_prompts, hf_reference, run_mcore
from helpers.tiny_hf import read_safetensors_dir, save_fused, tiny_qwen3_moe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen3")
    hf = tiny_qwen3_moe(base / "hf")
    mc = base / "mc"
    hf_to_mcore(hf, mc, show_progress=False)
    prompts = default_prompts(256)
    return {"base": base, "hf": hf, "mc": mc, "prompts": prompts, "ref": hf_reference(hf, prompts)}


def test_cli_verify_tp1_passes(ckpts, capsys):
    code = cli_main(["verify", "--hf-dir", str(ckpts["hf"]), "--mcore-dir", str(ckpts["mc"])])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS" in out and "layer   1 top-k routing agreement 1.0000" in out


@pytest.fixture(scope="module")
def tp2_run(ckpts):
    """One TP2 run serves two tests: parity, and megatron's own re-save of what it loaded."""
    resave = ckpts["base"] / "resave_tp2"
    return run_mcore(ckpts["mc"], ckpts["prompts"], tp=2, resave_dir=resave), resave


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2), dict(pp=2)], ids=["tp2", "ep2", "pp2"])
def test_layout_matches_hf(ckpts, tp2_run, layout):
    got = tp2_run[0] if layout == dict(tp=2) else run_mcore(ckpts["mc"], ckpts["prompts"], **layout)
    report = compare(ckpts["ref"], got, layout, tolerance=TOL)
    assert report.max_logit_diff <= TOL, report.lines()
    assert report.max_logprob_diff <= TOL, report.lines()
    assert report.routing_agreement == {0: 1.0, 1: 1.0}, report.lines()
    assert ckpts["ref"]["logits"].abs().max() > 0.1  # the comparison saw real numbers


def test_fused_layout_converts_identically(ckpts):
    fused = save_fused(ckpts["hf"], ckpts["base"] / "hf_fused")
    mc_fused = ckpts["base"] / "mc_fused"
    hf_to_mcore(fused, mc_fused, show_progress=False)
    a, b = TorchDistReader(ckpts["mc"]), TorchDistReader(mc_fused)
    assert a.tensors.keys() == b.tensors.keys()
    for key in a.tensors:
        assert torch.equal(a.read(key), b.read(key)), key


def test_round_trip_is_bit_exact_and_loads_in_transformers(ckpts):
    from transformers import AutoModelForCausalLM

    out = ckpts["base"] / "hf_back"
    mcore_to_hf(ckpts["mc"], out, max_shard_bytes=200_000, show_progress=False)
    original, back = read_safetensors_dir(ckpts["hf"]), read_safetensors_dir(out)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_megatron_resave_at_tp2_matches(ckpts, tp2_run):
    """megatron loads our checkpoint at TP2, saves its own: same tensors; its full state maps back to HF exactly."""
    out = tp2_run[1]
    ours, megatrons = TorchDistReader(ckpts["mc"]), TorchDistReader(out / "megatron_saved")
    assert set(megatrons.tensors) <= set(ours.tensors)
    for key in megatrons.tensors:
        assert torch.equal(ours.read(key), megatrons.read(key)), key
    # Our extra-state objects and common state are exactly the ones megatron writes.
    ours_objects = {k for k in ours.metadata.state_dict_metadata if k not in ours.tensors}
    megatron_objects = {k for k in megatrons.metadata.state_dict_metadata if k not in megatrons.tensors}
    assert megatron_objects == ours_objects

    # Reading megatron's own (TP2-written, split-chunk) checkpoint back to HF is exact too.
    back = ckpts["base"] / "hf_from_megatron"
    mcore_to_hf(out / "megatron_saved", back, hf_config=ckpts["mc"] / "hf_config.json", show_progress=False)
    original = read_safetensors_dir(ckpts["hf"])
    for name, tensor in read_safetensors_dir(back).items():
        assert torch.equal(tensor, original[name]), name

    # The weight-sync API: gather_full_state's tensors -> HF names and tensors.
    full = torch.load(out / "full_state.pt", weights_only=True)
    mapping = mapping_for(model_config_from_hf(json.loads((ckpts["hf"] / "config.json").read_text())), spec="local")
    assert set(full) == {key for unit in mapping.units() for key in unit.keys}
    pairs = dict(mapping.full_state_to_hf(full))
    assert pairs.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(pairs[name], tensor), name


def test_a_port_taken_before_rank_0_binds_it_costs_a_retry_not_the_run(ckpts, monkeypatch):
    """free_port can report a port that another job on the host takes before megatron's rank 0 binds it (a CI run
    beside other test sessions lost four tests to EADDRINUSE): the run retries on a new port."""
    import socket

    import checkpoints_tools.verify as verify
    from mpo.parallel.ports import free_port

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    handed: list[int] = []
    monkeypatch.setattr(verify, "free_port", lambda: handed.append(free_port() if handed else taken.getsockname()[1])
                        or handed[-1])
    try:
        got = run_mcore(ckpts["mc"], ckpts["prompts"])
    finally:
        taken.close()
    assert len(handed) == 2  # the taken port, then a new one
    assert compare(ckpts["ref"], got, {"tp": 1}, tolerance=TOL).max_logprob_diff <= TOL
