#!/usr/bin/env bash
# Make a stand-in for the CPU image's default base (python:<PYTHON_VERSION>-slim-bookworm) where Docker Hub cannot be
# reached: a Debian 12 root filesystem from Debian's own packages (mmdebstrap) plus this machine's CPython
# <PYTHON_VERSION>, imported as an image. Debian 12 ships Python 3.11 only and mpo requires >=3.12 (pyproject.toml), so
# the interpreter is copied from the host (a build against Debian 12's own libraries, e.g. pyenv's), without its
# site-packages: nothing installed on the host travels into the image but pip.
# Usage: bash docker/debian_base.sh <image tag>   (root; needs mmdebstrap and podman or docker)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:?usage: docker/debian_base.sh <image tag>}
engine=$(command -v podman || command -v docker) || { echo "debian_base.sh: install podman or docker" >&2; exit 1; }
version=$(sed -n 's/^PYTHON_VERSION=//p' docker/versions.env)
host_python=$(command -v "python$version") \
    || { echo "debian_base.sh: no python$version on PATH; install CPython $version (e.g. pyenv install $version) and rerun" >&2; exit 1; }
prefix=$("$host_python" -c 'import sys; print(sys.base_prefix)')
# The libraries CPython's own modules link against (ssl, sqlite3, ctypes, lzma, bz2, readline, uuid, ...).
libs=ca-certificates,libssl3,libsqlite3-0,libffi8,zlib1g,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libuuid1,libexpat1,libnsl2,libtirpc3,libcrypt1
root=$(mktemp -d /var/tmp/mpo-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
mmdebstrap --quiet --variant=minbase --include="$libs" bookworm "$root" http://deb.debian.org/debian
# The interpreter goes to /usr/local like the python:*-slim images; /usr/local/lib is on the loader's path there.
tar -C "$prefix" --exclude="lib/python$version/site-packages/*" --exclude="lib/python$version/test" \
    --exclude='__pycache__' -c bin lib include | tar -C "$root/usr/local" -x
chroot "$root" ldconfig
chroot "$root" /usr/local/bin/python$version -m ensurepip --upgrade >/dev/null 2>&1
for name in python python3 pip pip3; do
    target=$name; [[ $name == python* ]] && target=python$version; [[ $name == pip* ]] && target=pip$version
    [[ -e "$root/usr/local/bin/$name" ]] || ln -s "$target" "$root/usr/local/bin/$name"
done
chroot "$root" /usr/local/bin/python -c "import ssl, sqlite3, ctypes, lzma, bz2, uuid, venv; import sys; assert sys.version_info[:2] == tuple(map(int, '$version'.split('.'))), sys.version"
quiet=(); [[ "$engine" == *podman ]] && quiet=(--quiet)  # docker import has no such flag
tar -C "$root" -c . | "$engine" import "${quiet[@]}" --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "debian_base.sh: $tag = Debian 12 + CPython $("$host_python" -c 'import platform; print(platform.python_version())') from $prefix"
