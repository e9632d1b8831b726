#!/usr/bin/env bash
# The main job: sets up .venv (Python 3.12 + pinned stack) if needed, then runs the tiny end-to-end RL demo on CPU.
# Usage: bash launch/demo.sh [mpo demo args, e.g. --steps 20 --out runs/demo --loss rspo]
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_venv.sh
exec "$VENV_PY" -m mpo.cli demo "$@"
