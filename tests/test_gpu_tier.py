"""What the GPU tier does on a machine without CUDA (this suite's machines): tests/gpu is collected and skipped with
one reason, but FAILS under MPO_GPU_TIER=1 (how tests/gpu/run.sh runs it); `python -m mpo.bench gpu_step` exits
non-zero with one line; and the benchmark's parameter count, which its MFU rests on, matches transformers' own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU tier's behaviour without CUDA")


@cpu_only
def test_gpu_tier_is_collected_and_skipped_with_one_reason():
    env = {k: v for k, v in os.environ.items() if k != "MPO_GPU_TIER"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-ra", "-p",
                          "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**env, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout + run.stderr
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "GPU TIER SKIPPED: no CUDA device" in skipped[0], run.stdout
    assert " skipped" in run.stdout.splitlines()[-1] and "passed" not in run.stdout.splitlines()[-1], run.stdout


@cpu_only
def test_gpu_tier_fails_without_cuda_when_run_as_the_gpu_tier(monkeypatch):
    """The gate itself, in this process (the subprocess run above proves it is wired to every test of the tier)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "tests" / "gpu"))  # the conftest imports its sibling tier.py
    spec = importlib.util.spec_from_file_location("gpu_tier_conftest", REPO / "tests" / "gpu" / "conftest.py")
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)
    monkeypatch.setenv("MPO_GPU_TIER", "1")
    with pytest.raises(pytest.fail.Exception, match=r"GPU TIER BROKEN \(MPO_GPU_TIER=1\): torch.cuda.is_available"):
        gate._gate()
    monkeypatch.delenv("MPO_GPU_TIER")
    with pytest.raises(pytest.skip.Exception, match="GPU TIER SKIPPED: no CUDA device"):
        gate._gate()


@cpu_only
def test_gpu_step_bench_needs_cuda(capsys):
    from mpo.bench.__main__ import main

    assert main(["gpu_step"]) != 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().count("\n") == 0 and "needs a CUDA device" in captured.err


def test_gpu_step_parameter_count_matches_transformers():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from mpo.bench.gpu_step import parameter_counts, train_flops_per_token
    from mpo.models.config import preset, to_hf_config

    cfg = preset("gpu_1b")
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**to_hf_config(cfg)))
    counts = parameter_counts(cfg)
    assert counts.total == sum(p.numel() for p in hf.parameters())
    assert 1e9 <= counts.total <= 2e9, counts  # the issue's ~1-2B-parameter MoE
    # Active matmul weights: per layer attention + router + top-k of the experts, plus the LM head.
    attention = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim * cfg.hidden_size \
        + cfg.hidden_size * cfg.num_attention_heads * cfg.head_dim
    experts = cfg.router_topk * 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size
    router = cfg.num_experts * cfg.hidden_size
    assert counts.active_matmul == cfg.num_layers * (attention + experts + router) + cfg.vocab_size * cfg.hidden_size
    assert train_flops_per_token(cfg, 2048) > 6 * counts.active_matmul


# -- the offline tier (tests/gpu/bundle.sh, tests/gpu/run.sh --offline) ---------------------------------------------

def _bash(script: str, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", script, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_gpu_bundle_fits_the_limit_and_installs_offline_into_a_target(tmp_path):
    """bundle.sh downloads from PyPI (as CI can); over a limit it fails with one line; the bundle it writes installs
    with `pip --no-index --no-deps --target` and megatron.core imports from that directory."""
    too_small = _bash("tests/gpu/bundle.sh", env={"MPO_BUNDLE_LIMIT_MB": "1"})
    assert too_small.returncode != 0 and too_small.stderr.strip().count("\n") == 0, too_small.stderr
    assert "over the 1 MiB limit" in too_small.stderr
    made = _bash("tests/gpu/bundle.sh")
    assert made.returncode == 0, made.stderr
    manifest = [line.split() for line in (REPO / ".whl" / "MANIFEST").read_text().splitlines()
                if not line.startswith("#")]
    names = {row[0]: row for row in manifest}
    assert names["megatron_core"][1] == "0.19.2" and {"psutil", "pytest_timeout"} <= set(names), manifest
    assert sum(int(row[2]) for row in manifest) < 60 << 20
    ignored = subprocess.run(["git", "check-ignore", "-q", ".whl/MANIFEST"], cwd=REPO)
    assert ignored.returncode == 0, ".whl is not kept out of git"
    target = tmp_path / "deps"
    wheels = [str(REPO / ".whl" / row[4]) for row in manifest]
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                              str(target), *wheels], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    where = subprocess.run([sys.executable, "-c", "import megatron.core as m; print(m.__file__)"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(target)})
    assert where.returncode == 0 and where.stdout.strip().startswith(str(target)), where.stdout + where.stderr


@cpu_only
def test_offline_tier_without_cuda_exits_1_with_one_line():
    run = _bash("tests/gpu/run.sh", "--offline", env={"MPO_GPU_PYTHON": sys.executable}, timeout=180)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout == "" and run.stderr.strip().count("\n") == 0, run.stderr
    assert "no CUDA device" in run.stderr and "is_available() is 'False'" in run.stderr


@cpu_only
def test_cuda_ipc_bench_needs_cuda(capsys):
    from mpo.bench.__main__ import main

    assert main(["cuda_ipc"]) != 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().count("\n") == 0 and "needs a CUDA device" in captured.err


def test_cuda_ipc_bench_buckets_are_single_dtype_runs_within_the_size():
    from mpo.bench.cuda_ipc import buckets_of

    named = [("a", torch.zeros(100, dtype=torch.bfloat16)), ("b", torch.zeros(300, dtype=torch.bfloat16)),
             ("c", torch.zeros(100, dtype=torch.bfloat16)), ("head", torch.zeros(10, dtype=torch.float32)),
             ("d", torch.zeros(2000, dtype=torch.bfloat16))]
    buckets = buckets_of(named, bucket_bytes=800)
    assert [[name for name, _ in b] for b in buckets] == [["a", "b"], ["c"], ["head"], ["d"]]
    assert all(len({t.dtype for _, t in b}) == 1 for b in buckets)


def test_gpu_sync_worker_pushes_through_mpos_cuda_ipc_transport():
    """The GPU weight-sync test's CUDA IPC case is WeightSync's own cuda_ipc transport (it used to subclass the
    tensor transport and pickle its own payload)."""
    import importlib.util

    from mpo.rollout.client import EngineClient

    spec = importlib.util.spec_from_file_location("gpu_sync_worker", REPO / "tests" / "gpu" / "sync_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    client = EngineClient("http://127.0.0.1:9", timeout_s=1.0)
    sync = worker.make_sync(client, "cuda_ipc", bucket_mb=16)
    assert type(sync).__name__ == "WeightSync" and sync.transport == "cuda_ipc"
    assert worker.make_sync(client, "nccl", bucket_mb=16).transport == "distributed"
