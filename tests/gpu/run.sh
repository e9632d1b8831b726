#!/usr/bin/env bash
# The GPU tier on a CUDA machine: installs the GPU stack into its own venvs, runs `pytest -m gpu tests/gpu` with
# MPO_GPU_TIER=1 (a missing CUDA / Transformer Engine / SGLang then FAILS, it does not skip), then the one-GPU MFU
# benchmark `python -m mpo.bench gpu_step`, whose last line is the MFU. Exits non-zero if either fails.
#   .venv-gpu         Python 3.12 + tests/requirements-ci.txt (torch 2.14.1: PyPI's CUDA build) + transformer-engine
#                     at docker/versions.env's TRANSFORMER_ENGINE_VERSION (its PyTorch extension is compiled against
#                     that torch at install time: needs the CUDA toolkit, nvcc) + mpo
#   .venv-gpu-sglang  sglang at docker/versions.env's SGLANG_VERSION with its CUDA kernels (sgl-kernel), kept apart
#                     because sglang pins its own torch build
# Stamp files make a second run skip the installs. Usage: bash tests/gpu/run.sh [pytest args...]
# On a GPU machine WITHOUT network: bash tests/gpu/bundle.sh (on a machine with network), carry .whl, then
#   bash tests/gpu/run.sh --offline [STEP ...]   (tests/gpu/offline.sh: the image's python, no venv, no download)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--offline" ]; then
    shift
    exec bash tests/gpu/offline.sh "$@"
fi
source launch/find_python.sh
VENV=${MPO_GPU_VENV:-.venv-gpu}
SGLANG_VENV=${MPO_SGLANG_VENV:-.venv-gpu-sglang}
version_of() { grep "^$1=" docker/versions.env | cut -d= -f2; }
TE_VERSION=$(version_of TRANSFORMER_ENGINE_VERSION)
SGLANG_SPEC="sglang==$(version_of SGLANG_VERSION)"
fail() { echo "error: [gpu tier] $*" >&2; exit 1; }
pip_install() { "$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}"; }

nvidia-smi -L || fail "no NVIDIA GPU visible (nvidia-smi failed): the GPU tier needs one"
PY312=$(find_python312) || fail "Python 3.12 not found (see launch/setup_venv.sh for how to install it)"

# 1. The trainer's venv: the pinned stack + Transformer Engine + mpo.
want=$(cat tests/requirements-ci.txt pyproject.toml docker/versions.env | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.mpo-gpu-stamp" 2>/dev/null)" != "$want" ]; then
    [ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
    echo "[gpu tier] installing the pinned stack into $VENV" >&2
    pip_install "$VENV" -r tests/requirements-ci.txt setuptools wheel pybind11 ninja
    cuda_major=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda.split(".")[0])') \
        || fail "torch in $VENV is not a CUDA build"
    command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] \
        || fail "transformer-engine's PyTorch extension is compiled at install time: put the CUDA ${cuda_major} toolkit's nvcc on PATH or set CUDA_HOME"
    echo "[gpu tier] installing transformer-engine==$TE_VERSION (CUDA $cuda_major core; compiles its PyTorch extension)" >&2
    pip_install "$VENV" --no-build-isolation "transformer-engine[pytorch,core_cu${cuda_major}]==$TE_VERSION"
    pip_install "$VENV" --no-deps -e .
    "$VENV/bin/python" -c "
import torch, transformer_engine.pytorch, transformer_engine as te, mpo
assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'
assert te.__version__.startswith('$TE_VERSION'), te.__version__
print('[gpu tier] torch', torch.__version__, 'CUDA', torch.version.cuda, 'TE', te.__version__)" \
        || fail "$VENV: torch with CUDA + transformer_engine $TE_VERSION not importable (see above)"
    echo "$want" > "$VENV/.mpo-gpu-stamp"
fi

# 2. SGLang with its CUDA kernels, in its own venv (tests/gpu/sglang_gpu.py reads MPO_SGLANG_VENV).
if [ "$(cat "$SGLANG_VENV/.mpo-sglang-stamp" 2>/dev/null)" != "$SGLANG_SPEC" ]; then
    [ -x "$SGLANG_VENV/bin/python" ] || "$PY312" -m venv "$SGLANG_VENV"
    echo "[gpu tier] installing $SGLANG_SPEC into $SGLANG_VENV" >&2
    pip_install "$SGLANG_VENV" "$SGLANG_SPEC"
    "$SGLANG_VENV/bin/python" -c "import sglang, sgl_kernel; assert sglang.__version__ == '${SGLANG_SPEC#sglang==}'" \
        || fail "$SGLANG_VENV: '$SGLANG_SPEC' with sgl_kernel is not importable"
    echo "$SGLANG_SPEC" > "$SGLANG_VENV/.mpo-sglang-stamp"
fi

# 3. The tier (numbers are printed as [gpu] lines, hence -s), then the MFU benchmark.
export MPO_GPU_TIER=1 MPO_SGLANG_VENV="$SGLANG_VENV" PYTHONPATH="$PWD" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
status=0
"$VENV/bin/python" -m pytest -m gpu tests/gpu -ra -s "$@" || status=$?
"$VENV/bin/python" -m mpo.bench gpu_step || status=$?
exit $status
