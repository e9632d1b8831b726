"""The small files that make a torch_dist checkpoint a model of its own, and which directory a `model.mcore_dir` names.

A converted checkpoint (`checkpoints_tools hf-to-mcore`) keeps the HF `config.json` as `hf_config.json` and the
tokenizer, chat template and generation config as `hf_assets/`; every trainer checkpoint now carries the same
(copied before the checkpoint is committed, mpo.trainer.dist_checkpoint), from the run's `model.mcore_dir` when it
has them (a conversion or another trainer checkpoint), else from `model.hf_dir`. A run built from `model.preset`
has neither: its checkpoints carry no HF config, and exporting one needs `--hf-config`.

`resolve_mcore_dir` lets `model.mcore_dir` (and checkpoints_tools' `--mcore-dir`) name a torch_dist directory, a
trainer checkpoint's step directory, or a run directory (meaning its newest complete checkpoint).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"  # written last into a trainer checkpoint: its presence marks it complete
HF_CONFIG_NAME = "hf_config.json"  # the HF config.json, inside a torch_dist checkpoint
HF_ASSETS_DIR = "hf_assets"  # tokenizer / chat template / generation config files, inside a torch_dist checkpoint
WEIGHTS_INDEX = "model.safetensors.index.json"
_MAX_ASSET_BYTES = 64 << 20  # tokenizer files are a few MB; anything larger is not one


class NotACheckpoint(ValueError):
    """A directory given as a checkpoint is none (one line)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (one line, reported by the trainer's entry point)."""


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete trainer checkpoints in `root` (<out_dir>/checkpoints: step_<N> with their trainer state written
    last), oldest first."""
    found = [(int(p.name[5:]), p) for p in Path(root).glob("step_*")
             if p.name[5:].isdigit() and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint to resume from: the one `root/latest` names; None for a run that never completed one. A pointer
    that names nothing loadable (empty, garbage, a path outside the checkpoint directory, a deleted step) falls back
    to the newest complete checkpoint, saying so, and is a CheckpointError when there is none: a silent restart from
    step 0 would train over the run's metrics."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.exists() and not pointer.is_symlink():
        return None
    name = ""
    if pointer.is_file():  # not a FIFO or a directory: reading one would block or fail
        with pointer.open("rb") as f:
            name = f.read(256).decode("utf-8", errors="replace").strip()
    path = root / name
    if name.startswith("step_") and name[5:].isdigit() and (path / TRAINER_STATE).is_file():
        return path
    why = (f"{pointer} is not a regular file" if not pointer.is_file() else f"{pointer} is empty" if not name
           else f"{pointer} names {name[:80]!r}, not a complete checkpoint in {root}")
    complete = complete_checkpoints(root)
    if complete:
        log.warning("%s; resuming from the newest complete checkpoint, %s", why, complete[-1].name)
        return complete[-1]
    raise CheckpointError(f"{why}, and there is no complete checkpoint to resume from: refusing to restart the "
                          f"run from step 0 over its metrics (delete {pointer} to start it over)")


def is_asset(path: Path) -> bool:
    """An HF folder's file that travels with the weights: everything small that is not weights, the weight index or
    config.json (tokenizer files, chat template, generation_config.json)."""
    return (path.is_file() and path.suffix not in (".safetensors", ".bin", ".pt", ".pth")
            and path.name not in (WEIGHTS_INDEX, "config.json") and not path.name.startswith(".")
            and path.stat().st_size < _MAX_ASSET_BYTES)


def model_files_source(model: Any) -> tuple[Path | None, Path | None, Path | None]:
    """(HF config file, assets directory or HF folder, kind) for a ModelSection: from `mcore_dir` when it carries them,
    else from `hf_dir`; (None, None, None) for a preset model. The third item is the HF folder when the assets are
    its loose files (filtered by is_asset), None when they are an `hf_assets/` directory copied whole."""
    if model.mcore_dir:
        try:
            mcore = resolve_mcore_dir(model.mcore_dir)
        except NotACheckpoint:
            mcore = None
        if mcore is not None and (mcore / HF_CONFIG_NAME).is_file():
            assets = mcore / HF_ASSETS_DIR
            return mcore / HF_CONFIG_NAME, assets if assets.is_dir() else None, None
    if model.hf_dir and (Path(model.hf_dir) / "config.json").is_file():
        return Path(model.hf_dir) / "config.json", None, Path(model.hf_dir)
    return None, None, None


def copy_model_files(model: Any, dst: Path) -> None:
    """Write the run's HF config and assets into checkpoint directory `dst` (nothing for a preset model)."""
    config, assets, hf_dir = model_files_source(model)
    if config is None:
        return
    shutil.copy2(config, dst / HF_CONFIG_NAME)
    if assets is not None:
        shutil.copytree(assets, dst / HF_ASSETS_DIR)
    elif hf_dir is not None:  # its asset files, into hf_assets/ (created when there is any)
        for path in filter(is_asset, sorted(hf_dir.iterdir())):
            (dst / HF_ASSETS_DIR).mkdir(exist_ok=True)
            shutil.copy2(path, dst / HF_ASSETS_DIR / path.name)


def resolve_mcore_dir(path: str | Path) -> Path:
    """The torch_dist directory `path` names: itself when it holds `.metadata`; for a run directory (one with
    `checkpoints/`), its newest complete checkpoint (the `latest` pointer, as a resume reads it). NotACheckpoint (one
    line) otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise NotACheckpoint(f"{path}: no such directory")
    if (path / ".metadata").is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path if path.name == "checkpoints" else None
    if root is None:
        raise NotACheckpoint(f"{path}: not a torch_dist checkpoint (no .metadata) nor an mpo run directory (no "
                             "checkpoints/)")
    try:
        latest = latest_checkpoint(root)
    except CheckpointError as exc:
        raise NotACheckpoint(str(exc)) from None
    if latest is None:
        raise NotACheckpoint(f"{path}: the run has no complete checkpoint in {root}")
    return latest


def steps_of(run_dir: Path) -> list[int]:
    """The steps of a run's complete checkpoints, oldest first."""
    return [int(p.name[5:]) for p in complete_checkpoints(Path(run_dir) / "checkpoints")]

