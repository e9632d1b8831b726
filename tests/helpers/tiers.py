"""The optional test tiers (real SGLang: tests/test_sglang_*.py; real SLURM: tests/test_slurm_cluster.py) decide
here what a missing tier does, so both behave the same:

* in CI (`CI=true`, which CI services set): the tier must run, so its tests FAIL with one line naming the tier and
  the reason; no variable (MPO_SKIP_SLURM, MPO_SKIP_SGLANG_SETUP) turns that into a pass;
* outside CI: they skip, loudly (a banner on the terminal, a warning in the summary, "<TIER> TIER SKIPPED: why").
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import NoReturn

import pytest


def in_ci(env: dict[str, str] | None = None) -> bool:
    """CI=true (GitHub Actions, GitLab, ...) or CI=1."""
    return (os.environ if env is None else env).get("CI", "").strip().lower() in ("true", "1", "yes")


def tier_unavailable(tier: str, reason: str, request: pytest.FixtureRequest | None = None) -> NoReturn:
    """Fail (CI) or loudly skip (elsewhere) the calling test or fixture because `tier` cannot run. `reason` is folded
    into one line."""
    reason = " ".join(reason.split())
    if in_ci():
        pytest.fail(f"{tier} TIER UNAVAILABLE IN CI (CI=true, so it must run): {reason}", pytrace=False)
    message = f"{tier} TIER SKIPPED: {reason}"
    bar = "!" * 100
    print(f"\n{bar}\n{message}\n{bar}", file=sys.stderr)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter") if request is not None else None
    if reporter is not None:
        reporter.write_line("")
        reporter.write_sep("!", message, red=True, bold=True)
    warnings.warn(message, pytest.PytestWarning, stacklevel=2)
    pytest.skip(message)
