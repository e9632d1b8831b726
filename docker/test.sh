#!/usr/bin/env bash
# Build the CPU image and run it (called by .ci/run): `mpo demo` and a smoke subset of the suite inside the container
# (docker/in_container_check.sh), then the image's size and the build and run times. Last line:
#   container image_mb=<n> build_s=<b> demo_exact_first=<f> demo_exact_last=<l> tests_passed=<t>
# Uses podman (installed with apt when absent, with runc and mmdebstrap; needs root). Where Docker Hub cannot be
# reached, the base is Debian 12 from Debian's packages plus this machine's CPython (docker/debian_base.sh); where
# PyTorch's CPU wheel index cannot be reached, torch comes from PyPI with its CUDA wheels (a bigger image, said in the
# size). This machine's pip configuration and CA bundle are mounted into the build, never copied into the image; so is
# a pip cache, $MPO_PIP_CACHE (default /var/tmp/mpo-container-pip-cache, kept: a rerun on this machine skips the
# downloads; a fresh CI machine starts cold). Its images and containers are removed at the end (MPO_KEEP_IMAGE=1 keeps
# the image, tagged localhost/mpo-test:cpu, to look into a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "docker/test.sh: $*" >&2; }
missing=()
for tool in podman runc mmdebstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || { say "install ${missing[*]} (apt-get install -y podman runc mmdebstrap) or run as root"; exit 1; }
    say "installing ${missing[*]} with apt"
    # the lock timeout: .ci/run starts this beside the suite, whose Slurm tier may be installing its packages too
    apt-get -o DPkg::Lock::Timeout=600 update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq podman runc mmdebstrap >/dev/null
fi
work=$(mktemp -d /var/tmp/mpo-container-test.XXXXXX)
tag=localhost/mpo-test:cpu base=
cleanup() {
    podman rm -f "mpo-test-$$" >/dev/null 2>&1 || true
    [[ "${MPO_KEEP_IMAGE:-0}" == 1 ]] || podman rmi -f "$tag" >/dev/null 2>&1 || true
    [[ -z "$base" ]] || podman rmi -f "$base" >/dev/null 2>&1 || true
    podman image prune -f >/dev/null 2>&1 || true  # the build's untagged intermediate layers
    rm -rf "$work"
}
trap cleanup EXIT
# This machine refuses crun and podman's default ulimits: runc, and no default ulimits, for this script's podman only.
export CONTAINERS_CONF=$work/containers.conf
printf '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n' > "$CONTAINERS_CONF"
export MPO_CONTAINER_ENGINE=podman MPO_IMAGE=$tag

start=$(date +%s)
pip_cache=${MPO_PIP_CACHE:-/var/tmp/mpo-container-pip-cache}
mkdir -p "$pip_cache"
build_args=(--network host --volume "$pip_cache:/root/.cache/pip")
python_version=$(sed -n 's/^PYTHON_VERSION=//p' docker/versions.env)
if curl -s --max-time 10 -o /dev/null https://registry-1.docker.io/v2/; then
    say "Docker Hub answers: the default base python:$python_version-slim-bookworm"
else
    base=localhost/mpo-test-base:$$
    say "Docker Hub unreachable: building the base from Debian's packages ($base)"
    bash docker/debian_base.sh "$base"
    build_args+=(--build-arg "BASE_IMAGE=$base")
fi
if ! curl -s --max-time 10 -o /dev/null https://download.pytorch.org/whl/cpu/; then
    say "PyTorch's CPU index unreachable: torch from the configured index (PyPI's torch pulls CUDA's wheels)"
    build_args+=(--build-arg TORCH_EXTRA_INDEX=)
fi
python=$(command -v "python$python_version" || command -v python3)
mapfile -t -O "${#build_args[@]}" build_args < <("$python" docker/pip_build_config.py "$work")
bash docker/build.sh cpu "${build_args[@]}" > "$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log"; say "the CPU image's build failed (log above)"; exit 1; }
build_s=$(($(date +%s) - start))
image_mb=$(($(podman image inspect --format '{{.Size}}' "$tag") / 1000000))
say "built $tag in ${build_s}s, ${image_mb} MB"

start=$(date +%s)
# No network: the image must run from what it holds. The engine's shared-memory weight path needs more than 64 MB.
podman run --name "mpo-test-$$" --rm --network none --shm-size 2g "$tag" bash docker/in_container_check.sh \
    | tee "$work/run.log" || { say "the checks inside the container failed (above)"; exit 1; }
say "container checks took $(($(date +%s) - start))s"
echo "container image_mb=$image_mb build_s=$build_s $(tail -1 "$work/run.log")"
