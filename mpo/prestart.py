"""Checks that need files, processes or the network, run once by `mpo train` before any process starts.

`mpo.config_checks.validate` checks what the config says (model.mcore_dir's architecture included, from the checkpoint's
metadata); it also runs in every rank and in check-config, which may check a config before its model is in place,
or a multi-node one whose engines start elsewhere. These read a little more, once, so that a mistake costs one line
before start-up instead of a traceback from every rank after: the tokenizer fits the model's vocabulary (ids past it
have no embedding), engines the run starts itself can start (SGLang importable by the engine Python), engines given
by URL answer, the engines' NCCL is the trainer's (check_one_nccl; `launch` runs it too).

Each raises ConfigError with the field to change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mpo.config import ConfigError, TrainConfig
from mpo.config_checks import model_config

URL_CHECK_TIMEOUT_S = 5.0


def check_tokenizer_fits(config: TrainConfig) -> None:
    m = config.model
    where = m.tokenizer_dir or m.hf_dir
    if not where or not Path(where).is_dir():
        return
    from mpo.data.chat import load_tokenizer
    from mpo.data.sources import DataError

    field = "model.tokenizer_dir" if m.tokenizer_dir else "model.hf_dir"
    try:
        tokenizer = load_tokenizer(str(where))
    except DataError as exc:
        raise ConfigError(f"{field}: {exc}") from None
    vocab = model_config(config).vocab_size
    if len(tokenizer) > vocab:
        raise ConfigError(f"{field}={where}: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                          f"is {vocab}: ids from {vocab} on have no embedding; use the model's own tokenizer (or a "
                          f"model with vocab_size >= {len(tokenizer)})")


def check_local_engines_can_start(config: TrainConfig) -> None:
    """rollout.engine=sglang and no rollout.urls: `mpo train` starts SGLang with the engine Python, which needs it."""
    r = config.rollout
    if r.engine != "sglang" or r.urls:
        return
    python = os.environ.get("MPO_ENGINE_PYTHON") or sys.executable
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
    try:
        code = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        code, python = 3, f"{python} ({type(exc).__name__})"
    if code != 0:
        raise ConfigError(f"rollout.engine=sglang with no rollout.urls: the run starts SGLang itself with {python}, "
                          "which cannot import sglang; set MPO_ENGINE_PYTHON to a Python that has it "
                          "(e.g. .venv-sglang/bin/python), or give the engines' rollout.urls")


# Run by each interpreter whose NCCL is compared: its torch's NCCL version on stdout's last line ("2.27.3"), or
# "none: <why>" where that torch has no CUDA / NCCL (a CPU build).
NCCL_PROBE = """
import torch
try:
    v = torch.cuda.nccl.version() if torch.version.cuda else None
    print(".".join(map(str, v)) if isinstance(v, tuple) else v if v else "none: torch without CUDA")
except Exception as exc:
    print(f"none: {type(exc).__name__}: {exc}".splitlines()[0])
"""


def nccl_version(python: str | None = None) -> tuple[str | None, str]:
    """(NCCL version, "") of the torch in `python` (None: this process's own), or (None, why) where there is none
    (no CUDA build, no NCCL, or the interpreter could not tell)."""
    if python is None:
        import torch

        if not torch.version.cuda:
            return None, "torch without CUDA"
        try:
            v = torch.cuda.nccl.version()
        except Exception as exc:  # noqa: BLE001 - a torch without NCCL says so in its own words
            return None, f"{type(exc).__name__}: {exc}".splitlines()[0]
        return (".".join(map(str, v)) if isinstance(v, tuple) else str(v)), ""
    try:
        out = subprocess.run([python, "-c", NCCL_PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python} could not be run ({type(exc).__name__})"
    last = (out.stdout.strip().splitlines() or [""])[-1].strip()
    if out.returncode != 0 or not last or last.startswith("none"):
        return None, last.removeprefix("none: ") or f"{python} exited {out.returncode}"
    return last, ""


def check_one_nccl(trainer_python: str | None, engine_python: str) -> None:
    """The weight-update group (sync.transport=distributed on GPUs) is one NCCL communicator across the trainer's
    torch and the engines'; NCCL checks versions at bootstrap and two builds in one communicator are unsupported, so
    differing versions are refused here, before anything starts (ConfigError, one line). Where either side has no
    CUDA/NCCL (a CPU run: the group is gloo) there is nothing to compare: a debug line says so.
    docs/one_nccl.md: how both venvs get one NCCL."""
    import logging

    trainer, why_t = nccl_version(trainer_python)
    engine, why_e = nccl_version(engine_python)
    if trainer is None or engine is None:
        logging.getLogger(__name__).debug("NCCL versions not compared (trainer: %s; engines' %s: %s)",
                                          trainer or why_t, engine_python, engine or why_e)
        return
    if trainer != engine:
        raise ConfigError(f"sync.transport=distributed: the trainer's torch has NCCL {trainer} and the engines' "
                          f"({engine_python}) NCCL {engine}; one weight-update group needs one NCCL: install the "
                          f"engines' venv with the trainer's torch/nvidia-nccl wheel pinned, or load one libnccl in "
                          f"both (docs/one_nccl.md)")


def check_local_engines_nccl(config: TrainConfig) -> None:
    """SGLang engines this run starts itself, synced over the process-group path: their NCCL is the trainer's."""
    r = config.rollout
    if r.engine == "sglang" and not r.urls and config.sync.transport == "distributed":
        check_one_nccl(None, os.environ.get("MPO_ENGINE_PYTHON") or sys.executable)


def check_engine_urls_answer(config: TrainConfig) -> None:
    """Every rollout.urls engine answers /health (any HTTP answer counts: a 401 is an engine wanting a key)."""
    import urllib.error
    import urllib.request

    for i, url in enumerate(config.rollout.urls):
        try:
            urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=URL_CHECK_TIMEOUT_S).close()
        except urllib.error.HTTPError:
            continue
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConfigError(f"rollout.urls[{i}]={url}: no engine answers ({reason}); start it first, or fix the "
                              "address") from None


def before_start(config: TrainConfig) -> None:
    """Every check above: `mpo train` is about to start this node's ranks and engines."""
    check_tokenizer_fits(config)
    check_local_engines_can_start(config)
    check_local_engines_nccl(config)
    check_engine_urls_answer(config)
