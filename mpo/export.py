"""`mpo export RUN [--step N] --out DIR`: a trainer checkpoint as an HF folder that transformers and SGLang load as is.

The folder holds the policy's weights (safetensors shards and their index), `config.json`, the tokenizer files and
chat template, and `generation_config.json` (the HF folder's; without one, the special tokens of config.json). RUN is
a run directory (`logging.out_dir`); the checkpoint is its newest complete one (the `latest` pointer, as a resume
reads it) or step N. The conversion is `checkpoints_tools mcore-to-hf`, run in its own process (mpo does not import
the converter; its progress bar and one-line errors are its own): it reads each tensor from the checkpoint's shard
files one layer or expert slice at a time, so the export never holds the whole model in memory, and writes into a
temporary directory beside DIR that is renamed to DIR only when complete. Mistakes are one line each: no such run,
no such step, DIR exists, a checkpoint without an HF config (a `model.preset` run: pass `--hf-config`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from mpo.model_files import HF_CONFIG_NAME, NotACheckpoint, resolve_mcore_dir, steps_of


class ExportError(ValueError):
    """A bad `mpo export` argument (one line)."""


def checkpoint_of(run: str | Path, step: int | None) -> Path:
    """The step directory `mpo export RUN [--step N]` converts (ExportError otherwise)."""
    run = Path(run)
    if not run.is_dir():
        raise ExportError(f"{run}: no such run directory")
    if not (run / "checkpoints").is_dir():
        raise ExportError(f"{run}: no checkpoints/ (not an mpo run directory, or it saved no checkpoint yet)")
    steps = steps_of(run)
    if step is None:
        try:
            return resolve_mcore_dir(run)
        except NotACheckpoint as exc:
            raise ExportError(str(exc)) from None
    if step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise ExportError(f"{run}: no complete checkpoint of step {step} (complete ones: {have}; "
                          "logging.keep_checkpoints says how many are kept)")
    return run / "checkpoints" / f"step_{step}"


def export(run: str | Path, out: str | Path, *, step: int | None = None, hf_config: str | None = None,
           progress: bool = True, python: str = sys.executable) -> int:
    """Convert the run's checkpoint into `out`; the converter's exit status (0: done). ExportError: bad input."""
    checkpoint = checkpoint_of(run, step)
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"--out {out} exists: choose a new directory (an export never writes over one)")
    if hf_config is None and not (checkpoint / HF_CONFIG_NAME).is_file():
        raise ExportError(f"{checkpoint} carries no HF config ({HF_CONFIG_NAME}: a run from model.preset, or a "
                          "checkpoint saved before checkpoints carried one): pass --hf-config path/to/config.json")
    command = [python, "-m", "checkpoints_tools", "mcore-to-hf", "--mcore-dir", str(checkpoint), "--out-dir",
               str(out)]
    if hf_config is not None:
        command += ["--hf-config", hf_config]
    if not progress:
        command.append("--no-progress")
    print(f"mpo export: {checkpoint} -> {out}", file=sys.stderr, flush=True)
    return subprocess.call(command)


def add_parser(sub) -> None:
    """`mpo export`'s subcommand on mpo's CLI parser."""
    parser = sub.add_parser("export", help="a trainer checkpoint as an HF folder (weights, config, tokenizer, chat "
                            "template, generation config) for transformers and SGLang")
    parser.add_argument("run", help="the run directory (logging.out_dir)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    parser.add_argument("--out", required=True, help="the HF folder to write (must not exist)")
    parser.add_argument("--hf-config", default=None,
                        help="config.json to use (default: the one the checkpoint carries)")
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    """Run `mpo export` from parsed arguments; a bad argument is one line and exit status 2."""
    try:
        return export(args.run, args.out, step=args.step, hf_config=args.hf_config, progress=not args.no_progress)
    except ExportError as exc:
        print(f"mpo export: error: {exc}", file=sys.stderr)
        return 2
