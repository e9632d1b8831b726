#!/usr/bin/env bash
# The GPU tier on a machine with NO network (`bash tests/gpu/run.sh --offline`): the image's own python3 (its torch
# with CUDA, transformers, numpy, ...) plus the wheels tests/gpu/bundle.sh put in .whl/, installed with
# `pip --no-index --no-deps --target` (the image's python is itself a venv: a venv on top would not see its torch).
# Never touches the network. Each step runs under its own `timeout`, so a failure or a hang costs only that step:
#   env       what the machine is (GPU, torch, CUDA, NCCL, megatron, TE, SGLang, the layer spec mpo picks)
#   gpu_step  python -m mpo.bench gpu_step: MFU, tokens/s, peak memory of the ~1.5B MoE train step
#   rl_step   one RL step with mpo's engine on the GPU: bf16 body + FP32 head on both sides, R3
#   cuda_ipc  python -m mpo.bench cuda_ipc: the 1.5B model's buckets through CUDA IPC vs a device-to-device copy
#   parity    the local spec on the GPU (fp32 and bf16) against HF transformers fp32 on the CPU, same checkpoint
#   packing   python -m mpo.bench packing --world-size 1: packed (block-diagonal mask on the local spec) vs padded rows
#   rest      the rest of tests/gpu: what needs Transformer Engine or SGLang skips with one line naming it
# Logs go to $OUT (the device tool's output folder) or runs/gpu-offline, with gpu_results.json summarising every
# step (exit code, seconds, the numbers each step reported). Exits 1 at once, with one line, without CUDA.
# Usage: bash tests/gpu/run.sh --offline [STEP ...]   (default: every step, in the order above)
#        MPO_GPU_PYTHON (default python3), MPO_GPU_DEPS (default .gpu-deps) override the interpreter and target dir.
set -uo pipefail
cd "$(dirname "$0")/../.."
python=${MPO_GPU_PYTHON:-python3}
out=${OUT:-runs/gpu-offline}
deps=${MPO_GPU_DEPS:-.gpu-deps}
fail() { echo "error: [gpu tier offline] $*" >&2; exit 1; }

cuda=$(timeout 120 "$python" -c 'import torch; print(torch.cuda.is_available())' 2>&1 | tail -n 1)
[ "$cuda" = "True" ] || fail "no CUDA device: $python says torch.cuda.is_available() is '${cuda:-nothing}'"
[ -f .whl/MANIFEST ] || fail ".whl/MANIFEST not found: run 'bash tests/gpu/bundle.sh' on a machine with network and carry .whl"
"$python" - <<'EOF' || exit 1
import hashlib, pathlib, sys
for line in pathlib.Path(".whl/MANIFEST").read_text().splitlines():
    if line.startswith("#") or not line.strip():
        continue
    name, version, size, digest, file = line.split()
    data = pathlib.Path(".whl", file).read_bytes() if pathlib.Path(".whl", file).is_file() else b""
    if hashlib.sha256(data).hexdigest() != digest:
        sys.exit(f"error: [gpu tier offline] .whl/{file} is missing or does not match .whl/MANIFEST's sha256")
EOF
mkdir -p "$out"
rm -rf "$deps"
"$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$deps" .whl/*.whl \
    > "$out/install.log" 2>&1 || fail "pip install --no-index of .whl/ failed: $(tail -n 1 "$out/install.log")"
export PYTHONPATH="$PWD:$PWD/$deps${PYTHONPATH:+:$PYTHONPATH}"
export MPO_GPU_TIER=1 MPO_GPU_OFFLINE=1 MPO_GPU_RESULTS="$out/numbers.jsonl" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -f "$MPO_GPU_RESULTS" "$out/steps.jsonl"

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env gpu_step rl_step cuda_ipc parity packing rest)
pytest_gpu=("$python" -m pytest -m gpu -p no:cacheprovider -ra -s)
status=0
for name in "${steps[@]}"; do
    case "$name" in
        env)      limit=60;  cmd=("$python" tests/gpu/env_report.py) ;;
        gpu_step) limit=150; cmd=("$python" -m mpo.bench gpu_step) ;;
        rl_step)  limit=180; cmd=("${pytest_gpu[@]}" tests/gpu/test_gpu_rl_step.py -k mpo_engine) ;;
        cuda_ipc) limit=90;  cmd=("$python" -m mpo.bench cuda_ipc) ;;
        parity)   limit=90;  cmd=("${pytest_gpu[@]}" tests/gpu/test_gpu_local_parity.py) ;;
        packing)  limit=120; cmd=("$python" -m mpo.bench packing --world-size 1 --check 1e-4) ;;
        rest)     limit=60;  cmd=("${pytest_gpu[@]}" tests/gpu --deselect tests/gpu/test_gpu_rl_step.py::test_rl_step_with_mpo_engine
                                  --ignore tests/gpu/test_gpu_local_parity.py) ;;
        *) fail "unknown step '$name' (steps: env gpu_step rl_step cuda_ipc parity packing rest)" ;;
    esac
    echo "[gpu tier offline] $name (limit ${limit} s): ${cmd[*]}" >&2
    started=$(date +%s%N)
    timeout --kill-after=10 "$limit" "${cmd[@]}" > "$out/$name.log" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - started) / 1000000 ))
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((ms / 1000)).$(printf %03d $((ms % 1000))), \"limit_s\": $limit}" \
        >> "$out/steps.jsonl"
    tail -n 5 "$out/$name.log" | sed "s/^/  [$name] /" >&2
    echo "[gpu tier offline] $name: exit $rc in $((ms / 1000)) s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')" >&2
    [ $rc -eq 0 ] || status=1
done
"$python" tests/gpu/results.py "$out" || status=1
exit $status
