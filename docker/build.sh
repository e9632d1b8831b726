#!/usr/bin/env bash
# Build the images with the versions from docker/versions.env (the only place they are written).
# Usage: bash docker/build.sh gpu|cpu [extra docker build args, e.g. -t registry/mpo:gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: docker/build.sh gpu|cpu [docker build args]}; shift
args=()
while IFS='=' read -r key value; do
    [[ -z "$key" || "$key" == \#* ]] && continue
    args+=(--build-arg "$key=$value")
done < docker/versions.env
exec docker build -f "docker/Dockerfile.$kind" "${args[@]}" -t "mpo:$kind" "$@" .
