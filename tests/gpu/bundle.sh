#!/usr/bin/env bash
# Run on a machine WITH network (a CPU box): fetches the wheels the offline GPU machine's image lacks for the GPU tier
# into .whl/ (CPython 3.12, manylinux x86_64), writes .whl/MANIFEST (name version bytes sha256 per wheel), keeps .whl
# out of git (.git/info/exclude) and fails with one line if .whl plus the tracked files pass the carry limit.
# Then, on the GPU machine (no network): bash tests/gpu/run.sh --offline   (the device tool carries ".whl").
#
# What the image has (python 3.12, torch+CUDA, transformers, safetensors, numpy, pyyaml, tqdm, httpx, tensorboard,
# matplotlib, pytest) is not fetched. What the tier needs beyond it, each --no-deps (their dependencies are in the
# image: megatron-core needs torch, numpy, packaging):
#   megatron-core  at docker/versions.env's MEGATRON_CORE_VERSION (the trainer and mpo's engine)
#   psutil         megatron's torch_dist checkpoint writer imports it
#   pytest-timeout pyproject's pytest `timeout`: a hung collective fails its test instead of the 10-minute call
# Transformer Engine (a 276 MB CUDA core wheel plus a source-only torch extension) and SGLang (> 1.2 GB) cannot
# travel: the offline tier runs the local layer spec and mpo's engine, and says so.
# Usage: bash tests/gpu/bundle.sh [--extra PKG==VER ...]   (more --no-deps wheels, e.g. a reward's verifier)
#        MPO_BUNDLE_LIMIT_MB (default 60) sets the limit; MPO_BUNDLE_PYTHON the python whose pip downloads.
set -euo pipefail
cd "$(dirname "$0")/../.."
fail() { echo "error: [gpu bundle] $*" >&2; exit 1; }
version_of() { grep "^$1=" docker/versions.env | cut -d= -f2; }

packages=("megatron-core==$(version_of MEGATRON_CORE_VERSION)" "psutil" "pytest-timeout")
while [ $# -gt 0 ]; do
    case "$1" in
        --extra) [ $# -ge 2 ] || fail "--extra needs a requirement (e.g. --extra math-verify==0.9.0)"
                 packages+=("$2"); shift 2 ;;
        *) fail "unknown argument '$1' (usage: bash tests/gpu/bundle.sh [--extra PKG==VER ...])" ;;
    esac
done
limit_mb=${MPO_BUNDLE_LIMIT_MB:-60}
python=${MPO_BUNDLE_PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=$(command -v python3) || fail "no python3 on PATH"; fi
fi
"$python" -m pip --version >/dev/null 2>&1 || fail "$python has no pip"

rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64 any; do
    platforms+=(--platform "$p")
done
if ! log=$("$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" \
        -d .whl "${packages[@]}" 2>&1); then
    fail "pip download of ${packages[*]} failed: $(echo "$log" | grep -i error | head -n 1)"
fi

"$python" - "$limit_mb" <<'EOF'
import hashlib, pathlib, subprocess, sys

limit = int(sys.argv[1]) << 20
wheels = sorted(pathlib.Path(".whl").glob("*.whl"))
if not wheels:
    sys.exit("error: [gpu bundle] no wheel was downloaded")
lines = []
for wheel in wheels:
    name, version = wheel.name.split("-")[:2]
    data = wheel.read_bytes()
    lines.append(f"{name} {version} {len(data)} {hashlib.sha256(data).hexdigest()} {wheel.name}")
pathlib.Path(".whl/MANIFEST").write_text("# name version bytes sha256 file\n" + "\n".join(lines) + "\n")
tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(b"\0")
tracked_bytes = sum(p.stat().st_size for p in map(pathlib.Path, map(bytes.decode, filter(None, tracked)))
                    if p.is_file())
bundle_bytes = sum(w.stat().st_size for w in wheels)
total = tracked_bytes + bundle_bytes
if total > limit:
    sys.exit(f"error: [gpu bundle] .whl ({bundle_bytes / 2**20:.1f} MiB) + tracked files "
             f"({tracked_bytes / 2**20:.1f} MiB) = {total / 2**20:.1f} MiB, over the {limit >> 20} MiB limit")
print(f"[gpu bundle] {len(wheels)} wheels, {bundle_bytes / 2**20:.1f} MiB (+ {tracked_bytes / 2**20:.1f} MiB tracked "
      f"= {total / 2**20:.1f} MiB of {limit >> 20}); .whl/MANIFEST:")
print("\n".join("  " + line for line in lines))
EOF

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
