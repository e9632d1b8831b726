# Sourced by tests/run.sh and launch/demo.sh: makes .venv with Python 3.12 and the pinned stack, sets VENV_PY.
# Re-installs only when tests/requirements-ci.txt or pyproject.toml change.
source launch/find_python.sh
if [ ! -x .venv/bin/python ]; then
    PY312=$(find_python312) || {
        echo "error: Python 3.12 is required (megatron-core >= 0.17 needs it) and none was found." >&2
        echo "  Install it with pyenv ('pyenv install 3.12' then 'pyenv local 3.12'), apt ('apt-get install python3.12-venv')," >&2
        echo "  or https://www.python.org/downloads/, so that 'python3.12' is on PATH, then run this again." >&2
        exit 1
    }
    echo "[setup] creating .venv with $PY312" >&2
    "$PY312" -m venv .venv
fi
VENV_PY="$PWD/.venv/bin/python"
stamp=.venv/.mpo-install-stamp
want=$(cat tests/requirements-ci.txt pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing pinned requirements (torch is a large download on a fresh machine)" >&2
    "$VENV_PY" -m pip install -q --disable-pip-version-check -r tests/requirements-ci.txt 2>&1 | grep -v "is ignored: it is neither" >&2 || true
    "$VENV_PY" -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "is ignored: it is neither" >&2 || true
    "$VENV_PY" -c 'import torch, megatron.core, transformers, mpo' || { echo "error: install failed" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
export VENV_PY
