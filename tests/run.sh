#!/usr/bin/env bash
# The test command: creates .venv (Python 3.12) if missing, installs the pinned CPU stack and mpo, runs pytest.
# Usage: bash tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/venv.sh
exec "$VENV_PY" -m pytest "$@"
