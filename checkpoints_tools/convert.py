"""hf-to-mcore and mcore-to-hf: whole-checkpoint conversions, streamed one unit (layer or expert slice) at a time.

Both write into a temporary directory next to the target and rename it at the end, so a failure never leaves a
partial checkpoint behind; the target is locked against a second converter (checkpoints_tools.files). The megatron
directory also keeps the HF config.json (`hf_config.json`) and the HF tokenizer / generation files (`hf_assets/`)
so that mcore-to-hf can produce a servable HF directory on its own.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from checkpoints_tools.files import atomic_directory
from checkpoints_tools.hf_writer import StreamingSafetensorsWriter
from checkpoints_tools.progress import progress
from checkpoints_tools.torch_dist_io import ChunkSpec, TorchDistReader, write_torch_dist
from mpo.model_files import HF_ASSETS_DIR, HF_CONFIG_NAME, NotACheckpoint, is_asset, resolve_mcore_dir
from mpo.models.hf_mapping import ModelMapping, Spec, Unit, mapping_for, model_config_from_hf
from mpo.models.hf_source import INDEX_NAME, ConversionError, HFCheckpoint, read_json

CONVERSION_INFO = "conversion.json"
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "F8_E4M3": torch.bfloat16, "F8_E5M2": torch.bfloat16}  # FP8 is dequantised to bf16


@dataclass(frozen=True)
class ConversionReport:
    """What a conversion did.

    Attributes:
        direction: "hf-to-mcore" or "mcore-to-hf".
        architecture: HF architecture name.
        tensors: number of HF tensors read or written.
        bytes: bytes of tensor data written.
        seconds: wall time.
        skipped: HF tensors deliberately not converted (e.g. DeepSeek-V3 MTP layers).
    """

    direction: str
    architecture: str
    tensors: int
    bytes: int
    seconds: float
    skipped: tuple[str, ...] = ()


def _copy_assets(src: Path, dst: Path) -> None:
    """Tokenizer / generation config files: everything small that is not weights or the weight index."""
    for path in sorted(src.iterdir()):
        if is_asset(path) and path.name != INDEX_NAME:
            dst.mkdir(exist_ok=True)
            shutil.copy2(path, dst / path.name)


def _check_coverage(source: HFCheckpoint, mapping: ModelMapping) -> tuple[str, ...]:
    """Every HF weight must be used by the mapping (or be a known skip); returns the skipped names."""
    needed = mapping.hf_names()
    covered = source.consumed_names(needed)
    skipped, unused = [], []
    for name in source.weight_names():
        if name in covered:
            continue
        if any(name.startswith(prefix) for prefix in mapping.info.skipped_hf_prefixes):
            skipped.append(name)
        elif name == "lm_head.weight" and "output_layer.weight" not in {u.rule.key for u in mapping.units()}:
            skipped.append(name)  # tied embeddings: megatron reuses the input embedding
        else:
            unused.append(name)
    if unused:
        raise ConversionError(f"{len(unused)} checkpoint tensor(s) have no megatron counterpart for "
                              f"{mapping.info.architecture}", file=source.file_of(unused[0]), tensor=unused[0])
    return tuple(skipped)


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, *, spec: Spec = "both", dtype: torch.dtype | None = None,
                show_progress: bool = True) -> ConversionReport:
    """Convert an HF checkpoint directory into a megatron-core torch_dist checkpoint (layout-free)."""
    start = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    with HFCheckpoint.open(hf_dir) as source:
        model_config = model_config_from_hf(source.config, file=str(hf_dir / "config.json"))
        mapping = mapping_for(model_config, spec=spec)
        source.fused_experts  # raises on a mix of layouts before anything is written
        skipped = _check_coverage(source, mapping)
        if skipped:
            print(f"checkpoints_tools: skipping {len(skipped)} tensor(s) not used by megatron-core (e.g. "
                  f"{skipped[0]}); {mapping.info.skip_reason}", file=sys.stderr)
        units = list(mapping.units())
        # Check every tensor's presence and shape from the headers first: fail before writing anything.
        for unit in units:
            for name, shape in zip(unit.hf_names, unit.rule.hf_shapes):
                source.check_shape(name, shape)
        chunks = []
        for unit in units:
            unit_dtype = dtype or _stored_dtype(source, unit.hf_names[0])
            for key in unit.keys:
                chunks.append(ChunkSpec(key, unit.global_shape, unit.offsets, unit.sizes, unit_dtype,
                                        _producer(source, mapping, unit)))
        bar = iter(progress(range(len(chunks)), total=len(chunks), desc="hf-to-mcore", enabled=show_progress))
        written = [0]

        def on_chunk(chunk: ChunkSpec) -> None:
            next(bar, None)
            written[0] += int(torch.Size(chunk.sizes).numel()) * torch.empty((), dtype=chunk.dtype).element_size()

        with atomic_directory(out_dir) as tmp:
            write_torch_dist(tmp, chunks, {key: None for key in mapping.extra_state_objects()}, on_chunk=on_chunk)
            next(bar, None)
            (tmp / HF_CONFIG_NAME).write_text(json.dumps(source.config, indent=2) + "\n")
            _copy_assets(hf_dir, tmp / HF_ASSETS_DIR)
            info = {"source": str(hf_dir), "spec": spec, "model_config": asdict(model_config),
                    "vocab_rows": mapping.info.padded_vocab_size, "skipped_tensors": len(skipped)}
            (tmp / CONVERSION_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return ConversionReport("hf-to-mcore", model_config.architecture, len(mapping.hf_names()), written[0],
                            time.perf_counter() - start, skipped)


def _stored_dtype(source: HFCheckpoint, name: str) -> torch.dtype:
    stored = source.stored_name(name)  # a per-expert name: the fused tensor it is served from
    code = source.shard_with(stored).get_slice(stored).get_dtype()
    if code not in _SAFETENSORS_DTYPES:
        raise ConversionError(f"unsupported dtype {code}", file=source.file_of(stored), tensor=stored)
    return _SAFETENSORS_DTYPES[code]


def _producer(source: HFCheckpoint, mapping: ModelMapping, unit: Unit):
    def produce() -> torch.Tensor:
        tensors = [source.get(name, shape) for name, shape in zip(unit.hf_names, unit.rule.hf_shapes)]
        return mapping.to_mcore(unit, tensors)

    return produce


def mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, *, hf_config: str | Path | None = None,
                max_shard_bytes: int = 2 << 30, show_progress: bool = True) -> ConversionReport:
    """Convert a megatron-core torch_dist checkpoint (written by hf_to_mcore or by megatron at any layout) to HF."""
    start = time.perf_counter()
    try:  # a torch_dist directory, a trainer checkpoint's step directory, or a run directory (its newest checkpoint)
        mcore_dir = resolve_mcore_dir(mcore_dir)
    except NotACheckpoint as exc:
        raise ConversionError(f"--mcore-dir: {str(exc).removeprefix(str(mcore_dir) + ': ')}",
                              file=str(mcore_dir)) from None
    out_dir = Path(out_dir)
    config_path = Path(hf_config) if hf_config else mcore_dir / HF_CONFIG_NAME
    if not config_path.is_file():
        raise ConversionError("no HF config (a run from model.preset, or a checkpoint saved before they carried "
                              "one): pass --hf-config" if not hf_config else "--hf-config: no such file",
                              file=str(config_path))
    config = read_json(config_path)
    model_config = model_config_from_hf(config, file=str(config_path))
    reader = TorchDistReader(mcore_dir)
    mapping = mapping_for(model_config, spec="both")
    units = list(mapping.units())
    plan = []
    for unit in units:
        key = _stored_key(reader, unit)
        stored_dtype = reader.tensors[key].properties.dtype
        plan += [(name, shape, stored_dtype) for name, shape in zip(unit.hf_names, unit.rule.hf_shapes)]
    with atomic_directory(out_dir) as tmp:
        writer = StreamingSafetensorsWriter(tmp, plan, max_shard_bytes)
        for unit in progress(units, total=len(units), desc="mcore-to-hf", enabled=show_progress):
            for name, tensor in mapping.to_hf(unit, _read_unit(reader, mapping, unit)):
                writer.add(name, tensor)
        writer.close()  # raises unless every tensor of the plan was added, in its order
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        assets = mcore_dir / HF_ASSETS_DIR
        if assets.is_dir():
            for path in assets.iterdir():
                shutil.copy2(path, tmp / path.name)
        if not (tmp / "generation_config.json").exists():  # the special tokens as transformers derives them
            generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ConversionReport("mcore-to-hf", model_config.architecture, len(plan), writer.total_bytes,
                            time.perf_counter() - start)


def _stored_key(reader: TorchDistReader, unit: Unit) -> str:
    """The unit's key as stored (either spec's name)."""
    key = next((k for k in (*unit.keys, unit.rule.key, unit.rule.te_key) if k and reader.shape(k) is not None),
               None)
    if key is None:
        raise ConversionError("tensor not in the torch_dist checkpoint", file=str(reader.directory / ".metadata"),
                              tensor=unit.keys[0])
    return key


def _read_unit(reader: TorchDistReader, mapping: ModelMapping, unit: Unit) -> torch.Tensor:
    key = _stored_key(reader, unit)
    stored = reader.shape(key)
    if unit.rule.kind == "vocab":
        # Any vocabulary padding is accepted (megatron pads per TP size); rows past vocab_size are dropped.
        if len(stored) != 2 or stored[1] != unit.global_shape[1] or stored[0] < mapping.info.vocab_size:
            raise ConversionError(f"shape mismatch: checkpoint has {stored}, config implies "
                                  f"({mapping.info.vocab_size}+, {unit.global_shape[1]})",
                                  file=str(reader.directory), tensor=key)
        return reader.read(key, (0, 0), (mapping.info.vocab_size, stored[1]))
    if stored != unit.global_shape:
        raise ConversionError(f"shape mismatch: checkpoint has {stored}, config implies {unit.global_shape}",
                              file=str(reader.directory), tensor=key)
    return reader.read(key, unit.offsets, unit.sizes).reshape(unit.rule.unit_shape)
