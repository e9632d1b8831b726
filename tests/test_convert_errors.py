"""Bad inputs give one line naming file and tensor (exit 2) and leave no output; FP8 dequantisation; spec keys."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints_tools.cli import main as cli_main
from checkpoints_tools.verify import VerifyReport, compare
from mpo.models.hf_mapping import mapping_for, model_config_from_hf
from mpo.models.hf_source import HFCheckpoint, dequantize_fp8_blocks
from helpers.tiny_hf import tiny_qwen3_moe

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return tiny_qwen3_moe(tmp_path_factory.mktemp("pristine") / "hf")


@pytest.fixture
def hf(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "hf")


def _index(hf):
    return json.loads((hf / "model.safetensors.index.json").read_text())


def _write_index(hf, index):
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def _convert_fails(hf, tmp_path, capsys, *expected: str) -> str:
    out = tmp_path / "mc"
    code = cli_main(["hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err, err
    assert not out.exists(), "partial output left behind"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mc.tmp")], "temporary directory left behind"
    return err


def test_missing_shard(hf, tmp_path, capsys):
    shard = sorted(hf.glob("model-0000*.safetensors"))[3]
    tensor = next(n for n, f in _index(hf)["weight_map"].items() if f == shard.name)
    shard.unlink()
    _convert_fails(hf, tmp_path, capsys, shard.name, tensor)


def test_index_names_tensor_the_shard_lacks(hf, tmp_path, capsys):
    index = _index(hf)
    name = "model.layers.1.self_attn.k_proj.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    _write_index(hf, index)
    _convert_fails(hf, tmp_path, capsys, wrong, name)


def test_tensor_missing_from_index(hf, tmp_path, capsys):
    index = _index(hf)
    name = "model.layers.0.mlp.experts.5.up_proj.weight"
    del index["weight_map"][name]
    _write_index(hf, index)
    _convert_fails(hf, tmp_path, capsys, "model.safetensors.index.json", name)


def test_shape_mismatch(hf, tmp_path, capsys):
    name = "model.layers.1.self_attn.q_norm.weight"
    shard = hf / _index(hf)["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = torch.ones(8)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    err = _convert_fails(hf, tmp_path, capsys, shard.name, name, "shape mismatch")
    assert "(8,)" in err and "(16,)" in err


def test_unsupported_architecture(hf, tmp_path, capsys):
    config = json.loads((hf / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (hf / "config.json").write_text(json.dumps(config))
    _convert_fails(hf, tmp_path, capsys, "config.json", "LlamaForCausalLM", "unsupported architecture")


def test_existing_output_is_not_overwritten(hf, tmp_path, capsys):
    out = tmp_path / "mc"
    out.mkdir()
    (out / "keep").write_text("x")
    assert cli_main(["hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(out), "--no-progress"]) == 2
    assert (out / "keep").read_text() == "x"


def test_fp8_block_scaled_tensor_is_dequantised_on_read(hf):
    name = "model.layers.0.self_attn.o_proj.weight"  # [64, 64]: a 2x2 grid of 32-blocks in this test
    shard = hf / _index(hf)["weight_map"][name]
    tensors = load_file(str(shard))
    original = tensors[name]
    block = 32
    scale = original.abs().reshape(2, block, 2, block).amax(dim=(1, 3)) / 448.0
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    tensors[name] = (original / expanded).to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = scale
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = _index(hf)
    index["weight_map"][name + "_scale_inv"] = shard.name
    _write_index(hf, index)

    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (hf / "config.json").write_text(json.dumps(config))

    expected = dequantize_fp8_blocks(tensors[name], scale, (block, block))
    assert (expected.float() - original).abs().max() <= 0.07 * original.abs().max()  # FP8 precision
    with HFCheckpoint.open(hf) as source:
        got = source.get(name, (64, 64))
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
        assert name + "_scale_inv" not in source.weight_names()


def test_te_spec_key_names_follow_megatron_specs(pristine, monkeypatch):
    """Local-spec keys come from gpt_layer_specs' sharded_state_dict_keys_map; TE keys from the TE spec's modules.

    Transformer Engine is not installed here, so the TE spec is built with a stand-in provider that returns named
    placeholder modules: that is enough to read which norms are fused into which linear layer.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    mapping = mapping_for(model_config_from_hf(json.loads((pristine / "config.json").read_text())), spec="both")
    local = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False, qk_layernorm=True)
    keys_map = local.submodules.sharded_state_dict_keys_map

    class Placeholder:
        def __init__(self, role):
            self.role = role

    class FakeTE:
        def __getattr__(self, role):
            return lambda *a, **k: Placeholder(role)

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", FakeTE, raising=False)
    try:
        te = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True,
                                                                         qk_layernorm=True).submodules
    except Exception as exc:  # pragma: no cover - depends on megatron internals
        pytest.skip(f"TE spec cannot be assembled without TE: {exc}")
    te_map = te.sharded_state_dict_keys_map or {}

    def rename(module_key, key_map):
        for old, new in key_map.items():
            if module_key.startswith(old):
                return new + module_key[len(old):]
        return module_key

    rules = {rule.hf[0].split("}.", 1)[-1]: rule for rule in mapping.rules}
    pre_mlp = rules["post_attention_layernorm.weight"]
    input_norm = rules["input_layernorm.weight"]
    # Local spec: both norms are separate modules, renamed by its keys map.
    assert "decoder.layers." + rename("pre_mlp_layernorm.weight", keys_map) == pre_mlp.key
    assert "decoder.layers." + rename("input_layernorm.weight", keys_map) == input_norm.key
    # TE spec: the input norm is fused into linear_qkv (input_layernorm is an identity), pre-MLP norm of an MoE
    # layer is a separate module and keeps its own name.
    assert te.input_layernorm is gpt_layer_specs.IdentityOp
    assert isinstance(te.pre_mlp_layernorm, Placeholder)
    assert te.self_attention.submodules.linear_qkv.role == "column_parallel_layer_norm_linear"
    assert pre_mlp.te_key == "decoder.layers." + rename("pre_mlp_layernorm.weight", te_map)
    assert input_norm.te_key is None and input_norm.key.endswith("linear_qkv.layer_norm_weight")
    assert pre_mlp.keys("both") == (pre_mlp.key, pre_mlp.te_key)


def test_verify_report_fails_outside_tolerance():
    ids = torch.randint(0, 8, (1, 4))
    logits = torch.randn(1, 4, 8)
    routing = {0: torch.tensor([[0, 1]] * 4)}
    hf = {"logits": logits, "logprobs": torch.zeros(1, 4), "routing": routing}
    same = compare(hf, {**hf, "routing": dict(routing)}, {})
    assert same.passed and same.max_logit_diff == 0
    shifted = compare(hf, {**hf, "logits": logits + 1e-3}, {})
    assert not shifted.passed
    rerouted = compare(hf, {**hf, "routing": {0: torch.tensor([[0, 2]] + [[0, 1]] * 3)}}, {})
    assert not rerouted.passed and rerouted.routing_agreement[0] == 0.75
    assert isinstance(rerouted, VerifyReport) and ids.shape == (1, 4)
