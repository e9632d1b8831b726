"""Streaming writer of Hugging Face safetensors shards + `model.safetensors.index.json`.

Tensors are appended one at a time; a shard is flushed when adding the next tensor would exceed `max_shard_bytes`,
so memory holds at most one shard. Shard file names need the final count, so shards are renamed at `close()`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from checkpoints_tools.hf_source import INDEX_NAME


class ShardedSafetensorsWriter:
    """Collects (name, tensor) pairs into size-bounded safetensors shards inside `directory`."""

    def __init__(self, directory: Path, max_shard_bytes: int = 2 << 30) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0
        self.total_parameters = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        if name in self._pending or any(name in shard for shard in self._shards):
            raise ValueError(f"tensor {name} written twice")
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += size
        self.total_bytes += size
        self.total_parameters += tensor.numel()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        number = len(self._shards) + 1
        save_file(self._pending, str(self.directory / f"shard-{number:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Flush, give shards their final names and write the index."""
        self._flush()
        count = len(self._shards)
        weight_map = {}
        for number, names in enumerate(self._shards, 1):
            final = f"model-{number:05d}-of-{count:05d}.safetensors"
            (self.directory / f"shard-{number:05d}.tmp").rename(self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_parameters": self.total_parameters, "total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
