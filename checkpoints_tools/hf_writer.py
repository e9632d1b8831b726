"""Streaming writer of Hugging Face safetensors shards + `model.safetensors.index.json`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mpo.models.hf_source import INDEX_NAME

_SAFETENSORS_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}


class StreamingSafetensorsWriter:
    """Safetensors shards written tensor by tensor, holding no more than the tensor being written.

    A safetensors header lists every tensor's offsets, so names, shapes and dtypes are planned up front (the mapping
    knows them); tensors must then be added in plan order. Shards get their final names directly.
    """

    def __init__(self, directory: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int = 2 << 30) -> None:
        self.directory = directory
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype))
            size += nbytes
        self._shards = shards
        self._order = [entry for shard in shards for entry in shard]
        self._next = 0
        self._file = None
        self._shard_index = -1
        self._left_in_shard = 0
        self.total_bytes = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, s, d in self._order)
        self.total_parameters = sum(math.prod(s) for _, s, _ in self._order)
        count = len(shards)
        self.file_names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]

    def _open_next_shard(self) -> None:
        self._shard_index += 1
        entries, offset, header = self._shards[self._shard_index], 0, {"__metadata__": {"format": "pt"}}
        for name, shape, dtype in entries:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
        self._file = open(self.directory / self.file_names[self._shard_index], "wb")
        self._file.write(len(encoded).to_bytes(8, "little") + encoded)
        self._left_in_shard = len(entries)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, shape, dtype = self._order[self._next]
        if name != expected_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} out of plan: expected "
                             f"{expected_name} {shape} {dtype}")
        if self._left_in_shard == 0:
            self._open_next_shard()
        self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._next += 1
        self._left_in_shard -= 1
        if self._left_in_shard == 0:
            self._file.close()

    def close(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} planned tensors were never written")
        weight_map = {name: self.file_names[i] for i, shard in enumerate(self._shards) for name, _, _ in shard}
        index = {"metadata": {"total_parameters": self.total_parameters, "total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
