"""FP8 engines (issue 50, item 3): the trainer pushes block-FP8 weights (float8_e4m3fn, a float32 `weight_scale_inv`
per 128 x 128 block, as DeepSeek-V3 / Qwen3-FP8 checkpoints hold them) and mpo's engine loads them.

Checked against: a float64 reference written here (scales, round-to-nearest-even onto the e4m3 grid, padded edge
blocks); transformers' own save-side quantizer and dequantizer and SGLang's block dequantizer, as installed; the
layout of a DeepSeek-V3 FP8 checkpoint (names, shapes, safetensors dtypes, which tensors stay unquantized), built
tiny here and read back by mpo's own FP8 checkpoint reader; a real mpo engine process (tensor and shm payloads) and
the real trainer's streaming sync (two pipeline stages, two senders) holding dequantize(quantize(w)) bit for bit; a
real `mpo train` run recording the mismatch; the config's one-line error."""

from __future__ import annotations

import ast
import json
import math
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.cli import one_line, run_main
from mpo.config import RECIPES
from mpo.weight_sync.fp8 import (BLOCK, QUANTIZATION_CONFIG, dequantize_block, is_quantized,
                                 quantize_block, scale_name, scale_shape, to_engine_format, wire_bytes)

REPO = Path(__file__).resolve().parents[1]


# -- the float64 reference -------------------------------------------------------------------------------------------
def _e4m3_grid() -> np.ndarray:
    """The non-negative finite float8_e4m3fn values, indexed by their bit pattern (0x00 .. 0x7e; 0x7f is NaN)."""
    values = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    assert np.all(np.diff(values) > 0) and values[-1] == 448.0
    return values


def _round_e4m3(v: np.ndarray) -> np.ndarray:
    """float64 values (|v| <= 448) rounded to the nearest e4m3 value, ties to the even bit pattern."""
    grid = _e4m3_grid()
    mag = np.abs(v)
    hi = np.clip(np.searchsorted(grid, mag), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.copysign(grid[pick], v)


def _reference(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q values, weight_scale_inv, dequantized fp32 values) in float64, block by block, edge blocks on the elements
    they have: amax in float64; the scale as transformers computes it (448 / amax, one fp32 rounding); W * scale
    rounded to fp32 (the product transformers forms), clamped, then to e4m3 (the rounding this reference is about);
    scale_inv = 1 / scale (fp32)."""
    x = w.double().numpy()
    n, k = x.shape
    q = np.zeros_like(x)
    inv = np.zeros((math.ceil(n / BLOCK), math.ceil(k / BLOCK)))
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            block = x[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            amax = np.abs(block).max()
            # torch evaluates transformers' `448 / amax` (a Python number over a tensor) as reciprocal(amax) * 448:
            # two fp32 roundings, not one division
            scale = (np.float32(1.0) / np.float32(amax)) * np.float32(448.0) if amax > 0 else np.float32(1.0)
            inv[i, j] = np.float32(1.0) / scale
            scale = float(scale)
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = _round_e4m3(
                np.clip(block.astype(np.float32).astype(np.float64) * scale, -448, 448).astype(np.float32)
                .astype(np.float64))
    scale_full = np.repeat(np.repeat(inv, BLOCK, 0), BLOCK, 1)[:n, :k]
    return q, inv, (q * scale_full).astype(np.float32)  # q * scale_inv is exact in float64: one rounding to fp32


def _weight(shape: tuple[int, int], seed: int, dtype=torch.float32) -> torch.Tensor:
    """Normal values with a spread of magnitudes per block (e4m3 subnormals included), an all-zero block where the
    shape has a second row of blocks, and a block maximum that lands exactly on 448."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 0, shape[1])[None, :]
    if shape[0] > BLOCK:
        w[BLOCK:, :BLOCK] = 0.0
    w[0, 0] = -w.abs().max() * 1.5  # negative maximum of the first block
    return w.to(dtype)


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (130, 257), (1, 5), (200, 128), (576, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_quantization_matches_a_float64_reference(shape, dtype):
    w = _weight(shape, seed=sum(shape), dtype=dtype)
    q, inv = quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert inv.dtype == torch.float32 and tuple(inv.shape) == scale_shape(shape) == (-(-shape[0] // 128),
                                                                                     -(-shape[1] // 128))
    ref_q, ref_inv, ref_deq = _reference(w)
    assert np.array_equal(inv.double().numpy(), ref_inv)
    # scale_inv is amax / 448 to fp32 precision (two fp32 roundings on the way), 1 for an all-zero block
    x = w.double().numpy()
    for (i, j), value in np.ndenumerate(inv.double().numpy()):
        amax = np.abs(x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max()
        assert value == 1.0 if amax == 0 else abs(value - amax / 448) <= 2.5e-7 * amax / 448
    assert np.array_equal(q.double().numpy(), ref_q)  # every element on the e4m3 grid, nearest, ties to even
    assert q.double().abs().max() == 448.0  # the block maxima map to e4m3's largest value
    if shape[0] > 128:
        assert inv[1, 0] == 1.0 and not q[128:, :128].double().any()
    deq = dequantize_block(q, inv)
    assert deq.dtype == torch.float32 and np.array_equal(deq.numpy(), ref_deq)
    # e4m3 keeps 3 mantissa bits: each element within half an ulp of its scaled value (2^-4 relative; subnormals,
    # below 2^-6, have the ulp 2^-9), times its block's scale_inv
    block_inv = np.repeat(np.repeat(inv.double().numpy(), 128, 0), 128, 1)[:shape[0], :shape[1]]
    half_ulp = 2.0 ** -4 * np.maximum(np.abs(x) / block_inv, 2.0 ** -6)
    assert np.all(np.abs(deq.double().numpy() - x) <= half_ulp * block_inv * (1 + 1e-6))


def _installed_function(path: Path, name: str):
    """One top-level function of an installed source file, compiled on its own (its module's imports, e.g. all of
    sglang, are not needed by it and take a minute to import here)."""
    from typing import List, Optional, Tuple  # noqa: F401  (the function's annotations)

    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch, "List": List, "Optional": Optional, "Tuple": Tuple}
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace[name]


def test_fp8_matches_transformers_and_sglang_as_installed():
    """transformers' save-side quantizer (Fp8Quantize._quantize_one, the inverse-scale convention) gives the same
    bytes and scales where it quantizes (shapes that divide by the block; it leaves others unquantized, where
    DeepSeek-V3's checkpoints use ceil-division edge blocks, as we do); transformers' dequantizer and SGLang's
    block_quant_dequant give our dequantized values bit for bit, edge blocks included."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight
    from transformers.utils.quantization_config import FineGrainedFP8Config

    from helpers.sglang_server import sglang_venv

    config = FineGrainedFP8Config()
    assert list(config.weight_block_size) == QUANTIZATION_CONFIG["weight_block_size"]
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=config))
    for shape in [(128, 128), (256, 384)]:
        w = _weight(shape, seed=7, dtype=torch.bfloat16)
        theirs = quantizer._quantize_one("model.layers.0.mlp.down_proj.weight", w)
        q, inv = quantize_block(w)
        assert sorted(theirs) == ["model.layers.0.mlp.down_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight_scale_inv"]
        assert torch.equal(theirs["model.layers.0.mlp.down_proj.weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(theirs["model.layers.0.mlp.down_proj.weight_scale_inv"], inv)
    edge = _weight((130, 257), seed=3)
    assert list(quantizer._quantize_one("x.weight", edge)) == ["x.weight"]  # transformers: left unquantized

    found = sorted(sglang_venv().glob("lib/python*/site-packages/sglang/srt/layers/quantization/fp8_utils.py"))
    if not found:
        pytest.skip(f"no SGLang venv at {sglang_venv()} (tests/sglang_harness/setup.sh makes it)")
    sglang_dequant = _installed_function(found[0], "block_quant_dequant")
    for shape in [(130, 257), (576, 300), (128, 128), (1, 5)]:
        q, inv = quantize_block(_weight(shape, seed=11))
        ours = dequantize_block(q, inv)
        assert torch.equal(_dequantize_fp8_weight(q, inv, [128, 128], torch.float32), ours)
        assert torch.equal(sglang_dequant(q, inv, [128, 128], torch.float32), ours)


# -- the layout of a DeepSeek-V3 FP8 checkpoint ----------------------------------------------------------------------
# The dtypes DeepSeek-V3's FP8 checkpoint stores each kind of tensor in (its model.safetensors.index.json and shard
# headers), by name suffix; every F8_E4M3 weight comes with a "<name>_scale_inv" in F32.
DSV3_FP8_LAYOUT = {
    "embed_tokens.weight": "BF16", "lm_head.weight": "BF16", "model.norm.weight": "BF16",
    "input_layernorm.weight": "BF16", "post_attention_layernorm.weight": "BF16",
    "q_a_layernorm.weight": "BF16", "kv_a_layernorm.weight": "BF16",
    "self_attn.q_a_proj.weight": "F8_E4M3", "self_attn.q_b_proj.weight": "F8_E4M3",
    "self_attn.kv_a_proj_with_mqa.weight": "F8_E4M3", "self_attn.kv_b_proj.weight": "F8_E4M3",
    "self_attn.o_proj.weight": "F8_E4M3",
    "mlp.gate_proj.weight": "F8_E4M3", "mlp.up_proj.weight": "F8_E4M3", "mlp.down_proj.weight": "F8_E4M3",
    "mlp.gate.weight": "BF16", "mlp.gate.e_score_correction_bias": "BF16",
    "shared_experts.gate_proj.weight": "F8_E4M3", "shared_experts.up_proj.weight": "F8_E4M3",
    "shared_experts.down_proj.weight": "F8_E4M3",
    r"experts\.\d+\.gate_proj\.weight": "F8_E4M3", r"experts\.\d+\.up_proj\.weight": "F8_E4M3",
    r"experts\.\d+\.down_proj\.weight": "F8_E4M3",
}
# Real DeepSeek-V3 shapes and their scale shapes as the checkpoint stores them (ceil-division edge blocks)
DSV3_SCALES = {(576, 7168): (5, 56), (7168, 18432): (56, 144), (24576, 1536): (192, 12), (2048, 7168): (16, 56),
               (7168, 2048): (56, 16), (32768, 512): (256, 4)}


def _dsv3_kind(name: str) -> str:
    hits = [dtype for suffix, dtype in DSV3_FP8_LAYOUT.items()
            if re.search(r"(^|\.)" + (suffix if "\\" in suffix else re.escape(suffix)) + "$", name)]
    assert len(hits) == 1, f"{len(hits)} DeepSeek-V3 layout entries for {name}"
    return hits[0]


def _safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return {k: v for k, v in json.loads(raw[8:8 + size]).items() if k != "__metadata__"}


def test_fp8_checkpoint_layout_matches_deepseek_v3(tmp_path):
    """to_engine_format over every tensor of the tiny DeepSeek-V3 preset (bf16, as a bf16 trainer sends them) gives
    exactly the names, dtypes and shapes of a DeepSeek-V3 FP8 checkpoint; saved as one with the HF
    quantization_config, mpo's FP8 checkpoint reader (which reads the real ones) gets back our dequantized weights,
    and "bf16" passes every tensor through untouched."""
    from safetensors.torch import save_file

    from mpo.models.config import preset
    from mpo.models.hf_mapping import mapping_for
    from mpo.models.hf_source import HFCheckpoint

    assert {shape: scale_shape(shape) for shape in DSV3_SCALES} == DSV3_SCALES
    shapes = mapping_for(preset("tiny-dsv3"), spec="local").hf_shapes()
    g = torch.Generator().manual_seed(0)
    named = [(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in shapes.items()]
    assert all(a is b for (_, a), (_, b) in zip(to_engine_format(named, "bf16"), named))
    with pytest.raises(ValueError, match="engine weights format 'fp4'; valid values: 'bf16', 'fp8_block'"):
        next(to_engine_format(named, "fp4"))
    converted = list(to_engine_format(named, "fp8_block"))
    save_file(dict(converted), tmp_path / "model.safetensors")
    header = _safetensors_header(tmp_path / "model.safetensors")

    expected = {}
    for name, shape in shapes.items():
        kind = _dsv3_kind(name)
        expected[name] = (kind, list(shape))
        if kind == "F8_E4M3":
            expected[name + "_scale_inv"] = ("F32", [-(-shape[0] // 128), -(-shape[1] // 128)])
    assert {n: (h["dtype"], h["shape"]) for n, h in header.items()} == expected
    for i, (name, tensor) in enumerate(converted):  # each scale right after its weight (one bucket holds both)
        if name.endswith("_scale_inv"):
            assert converted[i - 1][0] == name[: -len("_scale_inv")]
    assert sum(wire_bytes(t.shape, 2, "fp8_block", n) for n, t in named) == \
        sum(t.numel() * t.element_size() for _, t in converted)

    config = {"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": QUANTIZATION_CONFIG}
    (tmp_path / "config.json").write_text(json.dumps(config))
    values = dict(converted)
    with HFCheckpoint.open(tmp_path) as ckpt:
        assert sorted(ckpt.weight_names()) == sorted(shapes)
        for name, tensor in named:
            want = dequantize_block(values[name], values[scale_name(name)]).to(torch.bfloat16) \
                if is_quantized(name, tensor.shape) else tensor
            assert torch.equal(ckpt.get(name, shapes[name]), want), name

    qwen = mapping_for(preset("tiny"), spec="local").hf_shapes()  # Qwen3-FP8: the same rules
    assert sorted(n for n, s in qwen.items() if not is_quantized(n, s)) == sorted(
        n for n in qwen if re.search(r"(embed_tokens|lm_head|norm|mlp\.gate)\.weight$", n))


# -- mpo's engine loads the format -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory):
    from mpo.rollout.engine_command import EngineSettings
    from mpo.rollout.local_engine import LocalEngineProcess

    process = LocalEngineProcess.mpo_engine(log_path=tmp_path_factory.mktemp("fp8") / "engine.log",
                                            settings=EngineSettings(dtype="bf16", api_key="k")).start()
    yield process
    process.stop()


def _checksum(engine) -> str:
    return engine.client.call("/weights_checksum", method="GET")["checksum"]


def _post(engine, path: str, body: dict):
    import httpx

    return httpx.post(f"{engine.url}{path}", json=body, headers={"Authorization": "Bearer k"}, timeout=60)


def test_fp8_engine_loads_the_dequantized_weights_bit_for_bit(bf16_engine):
    """A full update in fp8_block over the tensor payload (safetensors) and the shm locators: the bf16 engine then
    holds dequantize(quantize(w)) rounded to bf16 (its fp32 LM head: w itself), checksum for checksum. A weight in
    FP8 that checkpoints keep unquantized is refused (400); an FP8 weight whose scale never arrives fails the end
    of the session and leaves every weight as it was."""
    from mpo.models.config import preset
    from mpo.models.hf_mapping import mapping_for
    from mpo.weight_sync.shared_memory import SharedBuffer, file_name, locate, new_token
    from mpo.weight_sync.transports import WeightSync
    from mpo.weight_sync.verify import weights_checksum
    from mpo.weight_sync.wire import SHM_FORMAT, encode_mpo_bucket

    engine = bf16_engine
    shapes = mapping_for(preset("tiny"), spec="local").hf_shapes()
    for transport, seed in (("tensor", 1), ("shm", 2)):
        g = torch.Generator().manual_seed(seed)
        named = [(n, 0.1 * torch.randn(s, generator=g)) for n, s in shapes.items()]
        sync = WeightSync([engine.client], engine="mpo", transport=transport, bucket_bytes=1 << 20)
        sync.begin_session()
        converted = list(to_engine_format(named, "fp8_block"))
        for start in range(0, len(converted), 40):
            sync.push_bucket(converted[start:start + 40], version=seed)
        sync.end_session()
        sync.close()
        expected = [(n, t if n == "lm_head.weight" else
                     (dequantize_block(*quantize_block(t)) if is_quantized(n, t.shape) else t).to(torch.bfloat16))
                    for n, t in named]
        assert _checksum(engine) == weights_checksum(expected), transport
        assert _checksum(engine) != weights_checksum((n, t.to(torch.bfloat16) if n != "lm_head.weight" else t)
                                                     for n, t in named)
    before = _checksum(engine)

    q, inv = quantize_block(torch.randn(shapes["model.norm.weight"])[None])
    norm_fp8 = encode_mpo_bucket([("model.norm.weight", q[0])])
    engine.client.begin_weight_update()
    response = _post(engine, "/update_weights_from_tensor", {"serialized_named_tensors": [norm_fp8],
                                                              "load_format": "mpo_safetensors"})
    engine.client.end_weight_update()
    assert response.status_code == 400 and "keep it unquantized" in response.json()["message"], response.text

    name = "model.layers.0.self_attn.o_proj.weight"
    q, inv = quantize_block(torch.randn(shapes[name]))
    engine.client.begin_weight_update()
    response = _post(engine, "/update_weights_from_tensor", {
        "serialized_named_tensors": [encode_mpo_bucket([(name, q), ("model.norm.weight", torch.ones(64))])],
        "load_format": "mpo_safetensors"})
    assert response.status_code == 200, response.text
    ended = _post(engine, "/end_weight_update", {})
    assert ended.status_code == 400 and "without its 'model.layers.0.self_attn.o_proj.weight_scale_inv'" in \
        ended.json()["message"], ended.text
    assert _checksum(engine) == before  # not even the norm of that session was applied

    buffer = SharedBuffer(file_name(new_token(), "fp8"), inv.numel(), torch.float32, create=True)
    try:  # a scale through shm without its weight: refused at the end as well
        buffer.tensor.copy_(inv.view(-1))
        locator = locate(scale_name(name), buffer.tensor.view(inv.shape)).to_json()
        engine.client.begin_weight_update()
        response = _post(engine, "/update_weights_from_tensor", {"serialized_named_tensors": [json.dumps([locator])],
                                                                  "load_format": SHM_FORMAT})
        assert response.status_code == 200, response.text
        ended = _post(engine, "/end_weight_update", {})
        assert ended.status_code == 400 and "arrived without its float8_e4m3fn weight" in ended.json()["message"]
    finally:
        buffer.close()
    assert _checksum(engine) == before


# -- the trainer's streaming sync and a run --------------------------------------------------------------------------
def test_fp8_streaming_sync_gives_the_engine_the_dequantized_weights(tmp_path):
    """The real trainer at PP2 (two senders) publishes in fp8_block over shm and over the HTTP payload (pieces over
    gloo): the engine's weights are dequantize(quantize(w)) of the trainer's, bit for bit (checked against a full
    gather here, besides the publisher's own checksum), not the unquantized ones; sync_bytes counts the FP8 tensors
    and scales pushed, and the quantization error is reported."""
    from helpers import fp8_worker
    from helpers.spawn import spawn_ranks

    spawn_ranks(2, fp8_worker.fp8_streaming, str(tmp_path), ["shm", "tensor/gloo"])
    results = json.loads((tmp_path / "fp8_sync.json").read_text())
    assert sorted(results) == ["shm", "tensor/gloo"]
    for transport, got in results.items():
        assert got["engine_is_fp8"] and not got["engine_is_unquantized"], (transport, got)
        metrics = got["metrics"]
        assert metrics["sync_senders"] == 2 and metrics["sync_buckets"] >= 2
        assert metrics["sync_bytes"] == got["fp8_bytes"] < got["bf16_bytes"], (transport, got)
        assert 0.005 < metrics["sync_fp8_weight_rel_rmse"] < 0.05, metrics  # e4m3's 3 mantissa bits: ~2-3%


def test_fp8_run_records_the_mismatch(tmp_path):
    """`mpo train` on the demo with rollout.engine_weights=fp8_block (the engine generates from FP8 weights while
    the trainer holds fp32): every step logs the quantization error and the train-vs-rollout log-prob mismatch it
    causes, well above the unquantized engine's (<= 1e-5, tests/test_trainer.py)."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "mpo.cli", "train", "--config", str(RECIPES / "demo_cpu.yaml"),
               f"logging.out_dir={out}", "schedule.steps=2", "schedule.sft_steps=0", "data.prompts_per_step=4",
               "rollout.samples_per_prompt=4", "logging.checkpoint_every=0", "logging.progress=false",
               # filter_zero_variance=false: without a warm start no group has reward variance; it trains anyway
               "logging.tensorboard=false", "algorithm.filter_zero_variance=false",
               "rollout.engine_weights=fp8_block"]
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2, (rows, time.perf_counter() - began)
    for row in steps:
        assert 0.005 < row["sync_fp8_weight_rel_rmse"] < 0.05, row
        assert row["train_rollout_logprob_absdiff"] > 1e-4, row
        assert {"rollout_mismatch_k1", "rollout_mismatch_k3"} <= set(row), row  # the rollout-correction metrics


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine_weights=fp8"], "mpo: config error: rollout.engine_weights='fp8'; valid values: 'bf16', "
                                     "'fp8_block'"),
    (["rollout.engine_weights=fp8_block", "sync.transport=distributed"],
     "mpo: config error: rollout.engine_weights='fp8_block' with sync.transport='distributed' and rollout.engine="
     "'mpo': mpo's engine joins the group over gloo, which cannot broadcast float8; use sync.transport 'auto', 'shm' "
     "or 'tensor' (or engine_weights='bf16')"),
], ids=["fp8-unknown-format", "fp8-over-gloo"])
def test_fp8_config_errors_are_one_line(capsys, overrides, message):
    code, err = run_main(capsys, "mpo.cli", "check-config", "--config", str(RECIPES / "demo_cpu.yaml"), *overrides)
    assert code == 2 and one_line(err) == message


def test_fp8_deepseek_v3_recipe_pushes_fp8():
    from mpo.config_checks import load_config

    config = load_config(REPO / "mpo/recipes/deepseek_v3_gspo.yaml")
    assert config.rollout.engine_weights == "fp8_block" and config.rollout.engine == "sglang"
    assert load_config(RECIPES / "demo_cpu.yaml").rollout.engine_weights == "bf16"  # the default
