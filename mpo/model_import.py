"""One model path: `model.hf_dir` alone is converted once into a torch_dist checkpoint the trainer starts from.

Trainers start from a torch_dist checkpoint (`model.mcore_dir`); engines load the HF folder. A run given only the
HF folder used to start the trainer from random weights, and its first weight sync then overwrote the engines' real
ones. Now:

  * `mpo train` converts `model.hf_dir` once (`checkpoints_tools hf-to-mcore`, in its own process, with its progress
    bar) into `model.convert_dir` (default: `<logging.out_dir>/hf_converted`) and starts the trainer from it; a later
    run, or a resume, reuses the conversion while the HF folder's files are unchanged (a stamp of their names, sizes
    and modification times), and converts again when they changed;
  * the multi-node launcher and a trainer rank refuse the same config in one line naming the command to run
    (`refuse_without_weights`): conversion there is one job for one node before the others start;
  * random weights only when asked for by name: `model.random_init=true`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from mpo.config import ConfigError, TrainConfig

STAMP = "mpo-converted-from.json"
DEFAULT_DIR_NAME = "hf_converted"


def needs_conversion(config: TrainConfig) -> bool:
    """The trainer would have no weights: an HF folder, no torch_dist checkpoint, random weights not asked for."""
    m = config.model
    return bool(m.hf_dir) and not m.mcore_dir and not m.random_init


def conversion_dir(config: TrainConfig) -> Path:
    return Path(config.model.convert_dir or Path(config.logging.out_dir) / DEFAULT_DIR_NAME)


def convert_command(config: TrainConfig, python: str = "python") -> str:
    """The command a user runs to convert by hand (quoted as a shell line)."""
    import shlex

    return (f"{python} -m checkpoints_tools hf-to-mcore --hf-dir {shlex.quote(str(config.model.hf_dir))} "
            f"--out-dir {shlex.quote(str(conversion_dir(config)))}")


def refuse_without_weights(config: TrainConfig, *, where: str) -> None:
    """ConfigError (one line, the command to run) when `config` would train random weights without asking."""
    if needs_conversion(config):
        raise ConfigError(
            f"model.hf_dir is set and model.mcore_dir is not: {where} would train random weights and overwrite the "
            f"engines' real ones. Convert once with `{convert_command(config)}` and set "
            f"model.mcore_dir={conversion_dir(config)} (`mpo train` does this itself), or set "
            "model.random_init=true to train from scratch")


def _source_stamp(hf_dir: Path) -> dict:
    files = sorted(p for p in hf_dir.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
    return {"hf_dir": str(hf_dir.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _read_stamp(target: Path) -> dict | None:
    try:
        stamp = json.loads((target / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def ensure_converted(config: TrainConfig, *, python: str = sys.executable, env: dict | None = None) -> TrainConfig:
    """`config` with model.mcore_dir set to the HF folder's conversion, converting first when there is none that
    matches the folder's files; `config` itself when nothing is to convert. Raises ConfigError (one line) when the
    conversion fails (its own line is printed above) or the target is a directory mpo did not make."""
    if not needs_conversion(config):
        return config
    hf_dir, target = Path(config.model.hf_dir), conversion_dir(config)
    if not hf_dir.is_dir():
        raise ConfigError(f"model.hf_dir={hf_dir}: no such directory")
    want = _source_stamp(hf_dir)
    have = _read_stamp(target) if target.exists() else None
    if have != want:
        if target.exists():
            if have is None and any(target.iterdir()):
                raise ConfigError(f"model.convert_dir={target} exists and was not made by mpo (no {STAMP}); "
                                  "remove it or choose another directory")
            print(f"mpo: {hf_dir} changed since it was converted into {target}: converting again", file=sys.stderr)
            shutil.rmtree(target)
        print(f"mpo: converting model.hf_dir={hf_dir} into {target} (once; later runs and resumes reuse it)",
              file=sys.stderr, flush=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        command = [python, "-m", "checkpoints_tools", "hf-to-mcore", "--hf-dir", str(hf_dir), "--out-dir",
                   str(target)]
        code = subprocess.call(command, env={**os.environ, **(env or {})})
        if code != 0:
            raise ConfigError(f"model.hf_dir={hf_dir}: the conversion failed (exit {code}, its error is above); "
                              f"fix it and rerun, or run `{convert_command(config)}` yourself")
        (target / STAMP).write_text(json.dumps(want))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, mcore_dir=str(target)))
