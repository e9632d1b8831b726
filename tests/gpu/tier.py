"""The GPU tier's modes, for its conftest and tests: run by tests/gpu/run.sh (MPO_GPU_TIER=1), offline
(MPO_GPU_OFFLINE=1: no Transformer Engine, no SGLang can be installed there), or collected on a CPU machine."""

from __future__ import annotations

import os

import pytest


def gpu_tier_requested() -> bool:
    return os.environ.get("MPO_GPU_TIER") == "1"


def offline() -> bool:
    return os.environ.get("MPO_GPU_OFFLINE") == "1"


def needs_te() -> None:
    """Skip (offline, or outside the tier) or fail (online tier) unless Transformer Engine imports."""
    from mpo.parallel.device import transformer_engine_problem

    problem = transformer_engine_problem()
    if problem is None:
        return
    if gpu_tier_requested() and not offline():
        pytest.fail(f"GPU TIER BROKEN (MPO_GPU_TIER=1): {problem}", pytrace=False)
    pytest.skip(f"NEEDS TRANSFORMER ENGINE: {problem}")


def needs_sglang() -> None:
    """Skip offline (SGLang cannot travel to a machine without network); otherwise a missing SGLang fails."""
    from sglang_gpu import check_gpu_sglang

    try:
        check_gpu_sglang()
    except RuntimeError as exc:
        if offline():
            pytest.skip(f"NEEDS SGLANG (not installable offline): {str(exc).splitlines()[0][:300]}")
        raise
