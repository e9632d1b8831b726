"""Checks that need files, processes or the network, run once by `mpo train` before any process starts.

`mpo.config.validate` checks what the config says (model.mcore_dir's architecture included, from the checkpoint's
metadata); it also runs in every rank and in check-config, which may check a config before its model is in place,
or a multi-node one whose engines start elsewhere. These read a little more, once, so that a mistake costs one line
before start-up instead of a traceback from every rank after: the tokenizer fits the model's vocabulary (ids past it
have no embedding), engines the run starts itself can start (SGLang importable by the engine Python), engines given
by URL answer.

Each raises ConfigError with the field to change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mpo.config import ConfigError, TrainConfig, model_config

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
    check_engine_urls_answer(config)
