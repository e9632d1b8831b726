"""The GPU tier's gate: one reason to skip, and none under `bash tests/gpu/run.sh`.

Without CUDA every test here skips with the single reason NO_CUDA, reported at this file so that pytest -ra folds
the tier into one line ("SKIPPED [n] tests/gpu/conftest.py:..: GPU TIER SKIPPED: ...").
With MPO_GPU_TIER=1 (set by tests/gpu/run.sh) a machine without CUDA or Transformer Engine is an ERROR, not a skip:
a GPU run that silently proves nothing is the failure this tier exists to prevent.

Offline (MPO_GPU_OFFLINE=1, set by `tests/gpu/run.sh --offline` on a GPU machine without network, where neither TE
nor SGLang can be installed) CUDA is still required, but a test that needs TE or SGLang skips with one line naming
it (`needs_te()`, `needs_sglang()`), and everything else runs on megatron-core's local spec.
"""

from __future__ import annotations

import pytest
from tier import gpu_tier_requested, offline

NO_CUDA = "GPU TIER SKIPPED: no CUDA device (torch.cuda.is_available() is False)"


def _missing_pieces() -> list[str]:
    """What a GPU run needs and this machine lacks (empty when everything is there)."""
    import importlib.util

    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("torch.cuda.is_available() is False")
    if importlib.util.find_spec("transformer_engine") is None and not offline():
        missing.append("transformer_engine is not importable in this venv")
    return missing


def _gate() -> None:
    import torch

    if gpu_tier_requested():
        missing = _missing_pieces()
        if missing:
            pytest.fail("GPU TIER BROKEN (MPO_GPU_TIER=1): " + "; ".join(missing), pytrace=False)
    elif not torch.cuda.is_available():
        pytest.skip(NO_CUDA)


@pytest.fixture(scope="session", autouse=True)
def gpu_tier_gate() -> None:
    _gate()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """pytest reports a fixture's skip at each test's own line; point the tier's one reason at the gate instead, so
    the summary shows it once for the whole tier rather than once per test."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple) and report.longrepr[2].endswith(NO_CUDA):
        report.longrepr = (__file__, _gate.__code__.co_firstlineno, report.longrepr[2])
    return report
