"""Hand this machine's pip configuration to a container build without baking it into the image.

`pip config list` (files and PIP_* variables, merged as pip merges them) is written as one pip.conf into OUT_DIR, and
every local path it names (CA bundle, constraint file, find-links, and a file:// index with the directory above it,
where its links point) is printed as a read-only `--volume` at the same path, the pip.conf as one at /etc/pip.conf
(pip's site-wide file). A mount is not a layer: the image keeps none of it.
Usage: python docker/pip_build_config.py OUT_DIR  (prints the podman/docker build arguments, one per line)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PATH_KEYS = {"cert", "client-cert", "constraint", "requirement", "find-links", "extra-index-url", "index-url"}


def pip_settings() -> dict[str, str]:
    """Merged settings; PIP_* variables (':env:') win over files, as in pip."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    files, env = {}, {}
    for line in out.splitlines():
        scope_key, _, value = line.partition("=")
        scope, _, key = scope_key.rpartition(".")
        if scope not in ("global", "install", ":env:"):
            continue
        (env if scope == ":env:" else files)[key] = value.strip("'\"")
    return files | env


def local_paths(key: str, value: str) -> list[str]:
    if key not in PATH_KEYS:
        return []
    paths = []
    for item in value.split():
        if item.startswith("file:///"):  # a local index's pages link to files beside it (../../files/...)
            item = str(Path(item.removeprefix("file://")).parent)
        if item.startswith("/") and Path(item).exists():
            paths.append(item)
    return paths


def main(out_dir: str) -> None:
    settings = pip_settings()
    conf = ["[global]"] + [f"{k} = {v}" for k, v in sorted(settings.items())]
    (Path(out_dir) / "pip.conf").write_text("\n".join(conf) + "\n")
    print(f"--volume={Path(out_dir, 'pip.conf').resolve()}:/etc/pip.conf:ro")
    mounts = {p for k, v in settings.items() for p in local_paths(k, v)}
    # A mounted directory already holds what lies under it.
    for path in sorted(mounts):
        if not any(path != other and path.startswith(other.rstrip("/") + "/") for other in mounts):
            print(f"--volume={path}:{path}:ro")


if __name__ == "__main__":
    main(sys.argv[1])
