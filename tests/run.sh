#!/usr/bin/env bash
# The test command: creates .venv (Python 3.12) if missing, installs the pinned CPU stack and mpo, runs pytest.
# Usage: bash tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_venv.sh
# The real-SGLang tier (tests/test_sglang_*.py) runs the server from its own .venv-sglang, so sglang's pins never
# touch .venv. Outside CI a failed install is not fatal: those tests then skip with "SGLANG TIER SKIPPED: ...".
# In CI (CI=true) every tier must run: a failed install stops here, and a tier that cannot run fails its tests
# (tests/helpers/tiers.py). MPO_SKIP_SGLANG_SETUP=1 skips the install (the tier then needs .venv-sglang already).
if [ "${MPO_SKIP_SGLANG_SETUP:-0}" != 1 ]; then
    if ! bash tests/sglang_harness/setup.sh; then
        case "$(echo "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
            true|1|yes)
                echo "error: CI=true: the real-SGLang tier's set-up (tests/sglang_harness/setup.sh) failed" \
                     "(see above); in CI the tier must run" >&2
                exit 1 ;;
        esac
        echo "warning: sglang setup failed; the real-SGLang tests will be skipped (see above)" >&2
    fi
fi
# Two pytest workers (pytest-xdist): the suite's tests mostly wait on process start-up, engines and HTTP, and one
# worker kept ~1.1 of 2 cores busy. Modules stay whole on one worker, and the ones that share the SLURM cluster or
# start SGLang servers run one at a time (tests/conftest.py). MPO_TEST_WORKERS=1: one process, as before.
workers=${MPO_TEST_WORKERS:-2}
if [ "$workers" -gt 1 ]; then
    exec "$VENV_PY" -m pytest -n "$workers" "$@"
fi
exec "$VENV_PY" -m pytest "$@"
