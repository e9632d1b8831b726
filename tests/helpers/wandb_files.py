"""Reading an offline Weights & Biases run back (tests only): its history rows, from the run's .wandb file."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """The history rows of an offline W&B run, read from its .wandb file: a LevelDB-style log (7-byte ':W&B' header,
    32 KiB blocks of records [crc32, length u16, type u8] split FULL / FIRST / MIDDLE / LAST) of wandb Record
    protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pending, pos, block = {}, b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}  # wandb-core writes the key as a one-part nested_key
                rows[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def wandb_offline(monkeypatch, tmp_path: Path) -> None:
    """W&B offline, its per-user directories in the test's tmp dir (nothing in $HOME, nothing on the network)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
