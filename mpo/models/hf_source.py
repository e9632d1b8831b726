"""Lazy, tensor-by-tensor reading of a Hugging Face checkpoint directory (safetensors, sharded or not).

Tensors are opened through `safe_open` (mmap) and read one at a time, so memory stays near the largest tensor.
Two expert layouts are accepted, chosen per checkpoint:
  * per-expert (what transformers' save_pretrained writes): `...mlp.experts.{e}.gate_proj.weight` etc.;
  * fused (transformers 5's in-memory layout): `...mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) and
    `...mlp.experts.down_proj [E, H, I]`; a per-expert name is served as a slice of the fused tensor.
FP8 block-scaled tensors (`W` float8 with `W_scale_inv`, 128x128 blocks) are dequantised on read.

ConversionError is the one exception type for bad checkpoint inputs (here, in the HF mapping and in
checkpoints_tools, whose CLI prints it as one line and exits 2).
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FP8_BLOCK = 128
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


class ConversionError(Exception):
    """A checkpoint cannot be converted: unsupported architecture, missing shard or tensor, shape mismatch. The
    message is one line and names the file and the tensor involved."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None) -> None:
        parts = [message, *(f"{key}={value}" for key, value in (("file", file), ("tensor", tensor))
                            if value is not None)]
        super().__init__(" | ".join(parts).replace("\n", " "))
        self.file = file
        self.tensor = tensor


def read_json(path: str | Path) -> Any:
    """Parsed JSON; a missing, unreadable, non-UTF-8 or malformed file raises ConversionError naming file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConversionError(f"cannot read JSON file ({exc.strerror})", file=str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConversionError(f"not UTF-8 text (byte {exc.start})", file=str(path)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversionError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
                              file=str(path)) from None


def _inside(shard: str) -> bool:
    """`shard` names a file under the checkpoint's directory: relative, no `..`, no NUL. Judged on the name, not on
    the resolved path: HF's hub cache links every shard to a blob outside the snapshot directory, which is fine; an
    index that names `/etc/passwd` or `../../other/model.safetensors` is not."""
    path = PurePosixPath(shard)
    return bool(shard) and "\0" not in shard and not path.is_absolute() and ".." not in path.parts


@dataclass
class HFCheckpoint:
    """An opened HF checkpoint directory: config, tensor -> file map, lazily opened shards.

    Attributes:
        directory: the HF directory.
        config: the parsed config.json.
        weight_map: tensor name -> shard file name (from the index, or every tensor of model.safetensors).
        fp8_block: FP8 scale tile (rows, cols), from config.json's quantization_config.weight_block_size.
    """

    directory: Path
    config: dict[str, Any]
    weight_map: dict[str, str]
    fp8_block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)
    _stack: ExitStack = field(default_factory=ExitStack, repr=False)

    @classmethod
    def open(cls, directory: str | Path) -> "HFCheckpoint":
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ConversionError("HF directory has no config.json", file=str(config_path))
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise ConversionError("config.json is not a JSON object", file=str(config_path))
        index_path = directory / INDEX_NAME
        if index_path.is_file():
            index = read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConversionError("index has no weight_map object of tensor name -> shard file",
                                      file=str(index_path))
            weight_map = dict(weight_map)
            for shard in sorted(set(weight_map.values())):
                if _inside(shard) and (directory / shard).is_file():
                    continue
                tensor = next(name for name, s in weight_map.items() if s == shard)
                if not _inside(shard):
                    raise ConversionError(f"shard {shard[:100]!r} named in the index is not a file name inside the HF "
                                          "directory", file=str(index_path), tensor=tensor)
                raise ConversionError("shard named in the index is missing", file=str(directory / shard), tensor=tensor)
        elif (directory / SINGLE_NAME).is_file():
            with _open_safetensors(directory / SINGLE_NAME) as handle:
                weight_map = {name: SINGLE_NAME for name in handle.keys()}
        else:
            raise ConversionError(f"no {INDEX_NAME} or {SINGLE_NAME}", file=str(directory))
        block = (config.get("quantization_config") or {}).get("weight_block_size") or (FP8_BLOCK, FP8_BLOCK)
        return cls(directory, config, weight_map, (int(block[0]), int(block[1])))

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- layout detection -------------------------------------------------------------------------------------

    @property
    def fused_experts(self) -> bool:
        """True if experts are stored fused ([E, ...] tensors); raises on a mix of both layouts."""
        fused = any(_FUSED.match(n) for n in self.weight_map)
        per_expert = any(_PER_EXPERT.match(n) for n in self.weight_map)
        if fused and per_expert:
            name = next(n for n in self.weight_map if _FUSED.match(n))
            raise ConversionError("checkpoint mixes fused and per-expert expert tensors",
                                  file=str(self.directory / self.weight_map[name]), tensor=name)
        return fused

    def weight_names(self) -> list[str]:
        """Tensor names that carry weights (FP8 scale tensors are folded into their weights)."""
        return [n for n in self.weight_map if not n.endswith("_scale_inv")]

    # -- reading ----------------------------------------------------------------------------------------------

    def _handle(self, file_name: str):
        handle = self._handles.get(file_name)
        if handle is None:
            path = self.directory / file_name
            if not path.is_file():
                raise ConversionError("shard is missing", file=str(path))
            handle = self._stack.enter_context(_open_safetensors(path))
            self._handles[file_name] = handle
        return handle

    def file_of(self, name: str) -> str:
        return str(self.directory / self.weight_map.get(name, "?"))

    def shard_with(self, stored: str):
        """The open shard holding `stored` (a name of the index)."""
        handle = self._handle(self.weight_map[stored])
        if stored not in handle.keys():
            raise ConversionError("the index names a tensor the shard does not contain", file=self.file_of(stored),
                                  tensor=stored)
        return handle

    def _read_stored(self, name: str, index: tuple | None = None) -> torch.Tensor:
        """A tensor as stored (optionally a leading-axis slice), dequantised if FP8 block-scaled."""
        if name not in self.weight_map:
            raise ConversionError("tensor not in the checkpoint index", file=str(self.directory), tensor=name)
        handle = self.shard_with(name)
        try:
            tensor = handle.get_slice(name)[index] if index is not None else handle.get_tensor(name)
        except Exception as exc:  # safetensors' own error types (e.g. a data range past the end of the file)
            raise ConversionError(f"cannot read tensor data ({_first_line(exc)})", file=self.file_of(name),
                                  tensor=name) from None
        scale_name = f"{name}_scale_inv"
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and scale_name in self.weight_map:
            if index is not None:
                raise ConversionError("slicing a fused FP8 tensor is not supported", file=self.file_of(name),
                                      tensor=name)
            scale = self._read_stored(scale_name)
            tensor = dequantize_fp8_blocks(tensor, scale, self.fp8_block)
        return tensor

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor `name` (per-expert names are served from fused tensors if that is the layout).

        Raises ConversionError naming the file and tensor if it is missing or its shape is not `shape`.
        """
        tensor = self._read_stored(name) if name in self.weight_map else self._read_from_fused(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ConversionError(f"shape mismatch: checkpoint has {tuple(tensor.shape)}, config implies "
                                  f"{tuple(shape)}", file=self.file_of(name), tensor=name)
        return tensor

    def _read_from_fused(self, name: str) -> torch.Tensor:
        match = _PER_EXPERT.match(name)
        if match is None:
            raise ConversionError("tensor not in the checkpoint index", file=str(self.directory / INDEX_NAME),
                                  tensor=name)
        expert, proj, fused_name = int(match["expert"]), match["proj"], _fused(match)
        if fused_name not in self.weight_map:
            raise ConversionError("tensor not in the checkpoint index (neither per-expert nor fused)",
                                  file=str(self.directory / INDEX_NAME), tensor=name)
        sliced = self.shard_with(fused_name).get_slice(fused_name)
        num_experts = sliced.get_shape()[0]
        if expert >= num_experts:
            raise ConversionError(f"expert {expert} beyond fused tensor's {num_experts} experts",
                                  file=self.file_of(fused_name), tensor=fused_name)
        tensor = sliced[expert]
        if proj == "down_proj":
            return tensor
        rows = tensor.shape[0]
        if rows % 2:
            raise ConversionError(f"fused gate_up_proj has an odd row count {rows}", file=self.file_of(fused_name),
                                  tensor=fused_name)
        return expert_part(tensor, proj).clone()

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Shape of `name` from the safetensors header (no data read); per-expert names resolve into fused tensors."""
        stored = self.stored_name(name)
        shape = tuple(self.shard_with(stored).get_slice(stored).get_shape())
        if stored == name:
            return shape
        if name.endswith("down_proj.weight"):
            return shape[1:]
        return (shape[1] // 2, *shape[2:])

    def stored_name(self, name: str) -> str:
        """The name `name` is stored under: itself, or (a per-expert name) the fused tensor it is served from."""
        if name in self.weight_map:
            return name
        match = _PER_EXPERT.match(name)
        if match is None or _fused(match) not in self.weight_map:
            raise ConversionError("tensor not in the checkpoint index", file=str(self.directory / INDEX_NAME),
                                  tensor=name)
        return _fused(match)

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        got = self.shape_of(name)
        if got != tuple(shape):
            raise ConversionError(f"shape mismatch: checkpoint has {got}, config implies {tuple(shape)}",
                                  file=self.file_of(self.stored_name(name)), tensor=name)

    def consumed_names(self, per_expert_names: set[str]) -> set[str]:
        """Stored names covered by a set of requested names (fused tensors count when any slice was read)."""
        covered = {name for name in per_expert_names if name in self.weight_map}
        return covered | {_fused(match) for name in per_expert_names - covered if (match := _PER_EXPERT.match(name))}


def _fused(match: re.Match) -> str:
    """The fused tensor a per-expert name (a _PER_EXPERT match) is served from."""
    return f"{match['prefix']}.{'down_proj' if match['proj'] == 'down_proj' else 'gate_up_proj'}"


def fused_source(name: str) -> tuple[str, int, str] | None:
    """Where transformers 5's fused layout keeps the per-expert tensor `name`: (the fused tensor's name, the expert,
    gate_proj / up_proj / down_proj); None for a name that is not per-expert."""
    match = _PER_EXPERT.match(name)
    return None if match is None else (_fused(match), int(match["expert"]), match["proj"])


def expert_part(fused_expert: torch.Tensor, proj: str) -> torch.Tensor:
    """`proj` of one expert from that expert's row of a fused tensor, as a view: down_proj is the row itself;
    gate_up_proj holds [gate; up] along the output rows, gate first (transformers 5)."""
    if proj == "down_proj":
        return fused_expert
    half = fused_expert.shape[0] // 2
    return fused_expert[:half] if proj == "gate_proj" else fused_expert[half:]


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _open_safetensors(path: Path):
    """safe_open(path) whose failures (truncated file, corrupt header) are one-line ConversionErrors."""
    from safetensors import safe_open

    try:
        return safe_open(path, "pt")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ConversionError(f"cannot open safetensors file ({_first_line(exc)})", file=str(path)) from None


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """DeepSeek-style FP8 weight with one inverse scale per (rows x cols) tile -> `dtype`."""
    rows, cols = weight.shape
    if scale_inv.shape != (-(-rows // block[0]), -(-cols // block[1])):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not tile {tuple(weight.shape)} by {block}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)
