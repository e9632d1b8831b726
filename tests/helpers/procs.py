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


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after waiting up to `seconds` for all of them to go."""
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
