"""The weight sync's shape at scale (issue #50): flattened buckets (one buffer, one collective per bucket, whatever
the number of tensors), every pipeline stage pushing at once, and the shape stated by `mpo plan`. Real processes
throughout: 4 gloo ranks with megatron-core, a real mpo engine over HTTP, sglang 0.5.23's own unpacking code from
`.venv-sglang` (no sglang server: its receive side is the FlattenedTensorBucket code run here)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.spawn import spawn_ranks

REPO = Path(__file__).resolve().parents[1]

_SGLANG_SIDE = """
import base64, json, sys
import torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
payload, names, dtypes, shapes = json.load(sys.stdin)
data = MultiprocessingSerializer.deserialize(base64.b64decode(payload))  # sglang's SafeUnpickler
meta = [FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel) for m in data["metadata"]]
got = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta).reconstruct_tensors()
empty = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")  # the distributed path's receive buffer
print(json.dumps({"values": {n: t.double().flatten().tolist() for n, t in got},
                  "dtypes": {n: str(t.dtype) for n, t in got},
                  "flat": [str(data["flattened_tensor"].dtype), data["flattened_tensor"].numel()],
                  "empty": [empty.get_flattened_tensor().numel(), [[m.name, m.start_idx] for m in empty.metadata]]}))
"""


def test_flat_bucket_is_what_sglang_unpacks():
    """A bucket of mixed dtypes and odd sizes travels as ONE uint8 buffer (one payload, one handle, one broadcast),
    and sglang 0.5.23's own code reads it back exactly: its SafeUnpickler and FlattenedTensorBucket decode the
    tensor-path payload, and its FlattenedTensorBucket.empty (the distributed receive) lays the same names out at the
    same byte offsets as the manifest the trainer broadcasts from."""
    from helpers.sglang_server import server_env, sglang_available, sglang_python

    from mpo.weight_sync.wire import dtype_name, flattened_bucket_payload, manifest_of, pack_bucket, packed_order

    ok, why = sglang_available()
    if not ok:
        pytest.skip(why)
    g = torch.Generator().manual_seed(0)
    bucket = [("model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
              ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(5, 3, generator=g)),
              ("model.layers.0.mlp.experts.1.up_proj.weight", torch.randn(7, generator=g).to(torch.float16)),
              ("lm_head.weight", torch.randn(2, 3, generator=g).t())]  # a strided view, as q/k/v arrive
    flat, manifest = pack_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.is_contiguous() and flat.numel() == sum(m.numel for m in manifest)
    ordered = packed_order(bucket)
    specs = [[n for n, _ in ordered], [dtype_name(t.dtype) for _, t in ordered], [list(t.shape) for _, t in ordered]]
    assert manifest_of([(n, t.dtype, tuple(t.shape)) for n, t in ordered])[0] == manifest
    out = subprocess.run([str(sglang_python()), "-c", _SGLANG_SIDE], input=json.dumps(
        [flattened_bucket_payload(bucket), *specs]), env=server_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["flat"] == ["torch.uint8", flat.numel()], "not one uint8 buffer for the whole bucket"
    for name, tensor in bucket:
        assert got["dtypes"][name] == str(tensor.dtype)
        assert got["values"][name] == tensor.double().flatten().tolist(), name
    assert got["empty"] == [flat.numel(), [[m.name, m.start_idx] for m in manifest]]


def _engine(tmp_path: Path, preset: str):
    from mpo.rollout.local_engine import LocalEngineProcess

    engine = LocalEngineProcess.mpo_engine(log_path=tmp_path / "engine.log",
                                           extra_args=["--preset", preset, "--no-fp32-lm-head"])
    engine.startup_timeout_s = 600
    return engine


def test_flat_concurrent_stages_pp2_one_collective_per_bucket(tmp_path):
    """PP2 (DP2) with many small expert tensors into mpo's engine over the distributed transport: each bucket is one
    collective (not one per tensor), both stages' senders push at the same time (their push windows overlap, each
    with its own group to the engine), the engine applies the buckets in whatever order they came, and its
    checksum equals the trainer's after the concurrent sync."""
    from mpo.bench.weight_sync import _named_tensors, shape_rank

    preset = "sync_shape_bench"
    with _engine(tmp_path, preset) as engine:
        spawn_ranks(4, shape_rank, preset, engine.url, 16 << 10, 1, str(tmp_path / "shape.json"), (1, 1, 2))
    run = json.loads((tmp_path / "shape.json").read_text())
    assert len(run["senders"]) == 2
    together = [r[-1]["together"] for r in run["ranks"]]
    assert all(r["verified"] for r in together)  # rank 0 checked the engine's checksum (it raises otherwise)
    buckets = sum(r["buckets"] for r in together)
    collectives = sum(r["collectives"] for r in together)
    assert buckets > 10 and collectives <= 1.5 * buckets < len(_named_tensors(preset, 0)), (collectives, buckets)
    windows = [r["push_window"] for r in together if r["push_window"]]
    assert len(windows) == 2
    assert max(w[0] for w in windows) < min(w[1] for w in windows), f"the stages pushed one after the other: {windows}"


def test_shape_bench_pp2_ep2_last_line(tmp_path):
    """`python -m mpo.bench weight_sync --shape` as a user types it: a PP2 x EP2 sync of many small expert tensors,
    verified by the engine's checksum, ends with the sync-shape line; a bucket costs at most 1.5 collectives."""
    out = subprocess.run([sys.executable, "-m", "mpo.bench", "weight_sync", "--shape", "--rounds", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"sync-shape collectives_per_sync_vs_buckets=(\S+) stage_overlap=(\S+) "
                         r"fp8_bytes_vs_bf16=(\S+)", last)
    assert match, last
    x, y, z = (float(v) for v in match.groups())
    assert x <= 1.5 and y > 0 and (z != z or 0 < z < 1), last


def _plan_lines(recipe: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "mpo.cli", "plan", "--config", str(REPO / "mpo/recipes" / recipe)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 2), out.stderr[-3000:]
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("weight sync (sync.transport="))
    return lines[start: start + 4]


def test_shape_stated_by_mpo_plan():
    """`mpo plan` states the sync's shape: DeepSeek-V3's PP16 into 2 SGLang engines pushes all 16 stages at once
    (a group per sender and engine: 16 per engine GPU, one collective per bucket per engine), Qwen3-30B-A3B's single
    sender into 4 engines one broadcast per bucket; bytes per stage add up to the model's HF tensors in the trainer's
    dtype, and the estimated time is the busiest stage's link bytes at the stated bandwidth plus its calls."""
    import math

    from mpo.config_checks import load_config, model_config
    from mpo.models.hf_mapping import mapping_for

    for recipe, senders, engines, at_once in (("deepseek_v3_gspo.yaml", 16, 2, True),
                                              ("qwen3_30b_a3b_gspo.yaml", 1, 4, False)):
        head, groups, per_sync, estimate = _plan_lines(recipe)
        assert head.startswith(f"weight sync (sync.transport=distributed): {senders} sender(s)"), head
        assert ("pushing at once" in head) == at_once and f"to {engines} engine(s)" in head, head
        assert groups == f"  groups per engine GPU: {senders} (one per sender)"
        found = re.fullmatch(r"  per sync: (\d+) buckets, (\d+) collectives; GiB per stage: (.*)", per_sync)
        assert found, per_sync
        buckets, collectives = int(found[1]), int(found[2])
        assert collectives == buckets * (engines if at_once else 1)
        stage_gib = [float(v) for v in found[3].split(", ")]
        assert len(stage_gib) == senders
        config = load_config(REPO / "mpo/recipes" / recipe)
        itemsize = 2 if config.model.dtype == "bf16" else 4
        total = sum(math.prod(s) for u in mapping_for(model_config(config), spec="local").units()
                    for s in u.rule.hf_shapes) * itemsize / 2**30
        assert abs(sum(stage_gib) - total) < 0.01 * senders + 1e-6, (sum(stage_gib), total)
        found = re.fullmatch(r"  estimated sync time: (\S+) s at 23.3 GiB/s per sender link \((\S+) GiB on the busiest "
                             r"sender link, 0.1 ms per call\)", estimate)
        assert found, estimate
        link_gib = max(stage_gib) * (engines if at_once else 1)
        assert abs(float(found[2]) - link_gib) < 0.02 * (engines if at_once else 1), (found[2], link_gib)
        assert float(found[1]) >= link_gib * 2**30 / 25e9 * 0.99


def test_flat_manifest_refuses_a_misaligned_order():
    """sglang's receive buffer allows no padding, so a tensor must start at a multiple of its dtype size: the packed
    order (largest dtype first) always does, and a manifest in another order is refused in one line naming the fix
    (mpo's engine answers it as a 400 before any broadcast)."""
    from mpo.weight_sync.wire import manifest_of, pack_bucket

    bad = [("a", torch.bfloat16, (3,)), ("b", torch.float32, (2,))]
    with pytest.raises(ValueError, match=r"tensor 'b' \(float32\) would start at byte 6.*largest first"):
        manifest_of(bad)
    flat, manifest = pack_bucket([("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(2))])
    assert [(m.name, m.start_idx) for m in manifest] == [("b", 0), ("a", 8)] and flat.numel() == 14
