"""The process table, read from /proc: which processes of a run are still alive."""

from __future__ import annotations

from pathlib import Path


def live_processes_with_env(name: str, value: str) -> dict[int, str]:
    """Live (non-zombie) processes with `name=value` in their environment: pid -> cmdline. An environment variable
    is inherited by every descendant, also those that start their own session (torchrun's ranks, engines)."""
    wanted = f"{name}={value}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found
