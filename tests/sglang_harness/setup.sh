#!/usr/bin/env bash
# Idempotently creates .venv-sglang (Python 3.12) at the repository root and installs the real sglang there.
# Kept apart from .venv so the main test stack's pins (transformers, ...) are untouched: sglang brings its own.
# A stamp file makes a second run instant. Exits non-zero (with a message) if the install fails; tests/run.sh treats
# that as "sglang tier unavailable" (its tests skip loudly) outside CI, and stops with an error in CI (CI=true).
# Usage: bash tests/sglang_harness/setup.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
SGLANG_SPEC="sglang==0.5.23"
VENV=${MPO_SGLANG_VENV:-.venv-sglang}  # tests/helpers/sglang_server.py reads the same variable
stamp="$VENV/.mpo-sglang-stamp"
if [ "$(cat "$stamp" 2>/dev/null)" = "$SGLANG_SPEC" ]; then
    exit 0
fi
source launch/find_python.sh
fail() {
    echo "error: [sglang setup] $*" >&2
    echo "  The real-SGLang test tier (tests/test_sglang_*.py) will be SKIPPED (or FAIL, in CI)." >&2
    exit 1
}
if [ ! -x "$VENV/bin/python" ]; then
    PY312=$(find_python312) || fail "Python 3.12 not found (see launch/setup_venv.sh for how to install it)"
    echo "[sglang setup] creating $VENV with $PY312" >&2
    "$PY312" -m venv "$VENV" || fail "could not create $VENV"
fi
echo "[sglang setup] installing $SGLANG_SPEC into $VENV (about 6 min and 11 GB on a fresh machine)" >&2
start=$(date +%s)
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$SGLANG_SPEC" 2>&1 \
    | grep -v "is ignored: it is neither" >&2
PYTHONPATH=tests/sglang_harness SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "import sglang, sgl_kernel; assert sglang.__version__ == '${SGLANG_SPEC#sglang==}', sglang.__version__" \
    || fail "'pip install $SGLANG_SPEC' did not give an importable sglang in $VENV"
echo "$SGLANG_SPEC" > "$stamp"
echo "[sglang setup] done in $(( $(date +%s) - start )) s" >&2
