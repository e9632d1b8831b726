"""The optional tiers (real SGLang, real SLURM) in CI: a tier that cannot run fails the run with one line naming it;
outside CI it skips loudly. Runs tests/run.sh itself, with the SGLang venv pointed at a path that has none."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers.tiers import tier_unavailable

REPO = Path(__file__).resolve().parents[1]


def test_missing_tier_fails_in_ci_and_skips_loudly_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as failed:
        tier_unavailable("SLURM", "slurm/local_cluster.sh start failed:\n  need root")
    assert str(failed.value) == ("SLURM TIER UNAVAILABLE IN CI (CI=true, so it must run): slurm/local_cluster.sh "
                                 "start failed: need root")
    monkeypatch.delenv("CI")
    with pytest.warns(pytest.PytestWarning, match="SLURM TIER SKIPPED"):
        with pytest.raises(pytest.skip.Exception) as skipped:
            tier_unavailable("SLURM", "no slurmctld")
    assert str(skipped.value) == "SLURM TIER SKIPPED: no slurmctld"


def _run_sh(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("CI", "MPO_SKIP_SGLANG_SETUP", "PYTEST_ADDOPTS")}
    return subprocess.run(["bash", "tests/run.sh", *args], cwd=REPO, env={**full, **env}, capture_output=True,
                          text=True, timeout=600)


def test_run_sh_in_ci_fails_naming_the_missing_sglang_tier():
    """`CI=true MPO_SKIP_SGLANG_SETUP=1 bash tests/run.sh` without an SGLang venv: exit non-zero, the SGLang tests
    fail (not skip) with the tier's one-line reason."""
    out = _run_sh(["tests/test_sglang_sync.py", "-x", "-q", "-p", "no:cacheprovider"], CI="true",
                  MPO_SKIP_SGLANG_SETUP="1", MPO_SGLANG_VENV="/nonexistent/mpo-venv-sglang")
    assert out.returncode != 0, out.stdout[-2000:]
    assert "SGLANG TIER UNAVAILABLE IN CI (CI=true, so it must run): /nonexistent/mpo-venv-sglang/bin/python not " \
           "found" in out.stdout, out.stdout[-2000:]
    assert "skipped" not in out.stdout.splitlines()[-1]


def test_run_sh_in_ci_stops_when_sglang_setup_fails():
    """A failed SGLang install (its venv cannot be created under /proc) stops the CI run with one error line; outside
    CI it warns and pytest runs."""
    venv = "/proc/mpo-no-venv-sglang"
    ci = _run_sh(["--version"], CI="true", MPO_SGLANG_VENV=venv)
    assert ci.returncode == 1
    assert "error: CI=true: the real-SGLang tier's set-up (tests/sglang_harness/setup.sh) failed" in ci.stderr
    local = _run_sh(["--version"], MPO_SGLANG_VENV=venv)
    assert local.returncode == 0, local.stderr[-2000:]
    assert "warning: sglang setup failed" in local.stderr
