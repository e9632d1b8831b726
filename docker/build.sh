#!/usr/bin/env bash
# Build the images with the versions from docker/versions.env (the only place they are written), with docker or
# podman, whichever works (docker only with a daemon that answers; MPO_CONTAINER_ENGINE=docker|podman picks one).
# Usage: bash docker/build.sh gpu|cpu [extra build args, e.g. --build-arg BASE_IMAGE=... or -t registry/mpo:gpu]
# The image is tagged mpo:<kind> (MPO_IMAGE=name:tag to tag it otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: docker/build.sh gpu|cpu [build args]}; shift
engine=${MPO_CONTAINER_ENGINE:-}
if [[ -z "$engine" ]]; then
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
    elif command -v podman >/dev/null; then engine=podman; fi
fi
[[ -n "$engine" ]] || { echo "docker/build.sh: neither docker nor podman found; install one (e.g. apt-get install podman)" >&2; exit 1; }
args=()
while IFS='=' read -r key value; do
    [[ -z "$key" || "$key" == \#* ]] && continue
    args+=(--build-arg "$key=$value")
done < docker/versions.env
exec "$engine" build -f "docker/Dockerfile.$kind" "${args[@]}" -t "${MPO_IMAGE:-mpo:$kind}" "$@" .
