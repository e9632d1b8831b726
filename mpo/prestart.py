"""Checks that need files or the network, run once before any process starts (`mpo train`, `mpo check-config`).

`mpo.config.validate` checks what the config says; it also runs in every rank, so it reads nothing large. These read
a little more, once, so that a mistake costs one line before start-up instead of a traceback from every rank after:

  * model.mcore_dir holds the configured architecture (its tensors' shapes, from the checkpoint's metadata);
  * `mpo train` only (check-config may check a config before its model is in place, or a multi-node one whose
    engines start elsewhere): the tokenizer fits the model's vocabulary (ids past it have no embedding), engines the
    run starts itself can start (SGLang importable by the engine Python), engines given by URL answer.

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


def _by_suffix(shapes: dict[str, tuple[int, ...]], suffix: str) -> tuple[int, ...] | None:
    return next((shape for key, shape in shapes.items() if key.endswith(suffix)), None)


def check_checkpoint_architecture(config: TrainConfig) -> None:
    """model.mcore_dir's embedding, layer count and expert count are the configured model's."""
    if not config.model.mcore_dir:
        return
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mpo.model_files import NotACheckpoint, resolve_mcore_dir
    from mpo.safe_load import CheckpointFileError, read_dcp_metadata

    directory = Path(config.model.mcore_dir)
    try:  # a conversion, a trainer checkpoint's step directory, or a run directory (its newest)
        metadata = read_dcp_metadata(resolve_mcore_dir(directory) / ".metadata")
    except (CheckpointFileError, NotACheckpoint) as exc:
        raise ConfigError(f"model.mcore_dir: {exc}") from None
    shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    cfg = model_config(config)
    source = "model.hf_dir's config.json" if config.model.hf_dir else f"model.preset={config.model.preset}"
    found, expected = [], []
    embedding = _by_suffix(shapes, "embedding.word_embeddings.weight")
    if embedding is not None and embedding != (cfg.vocab_size, cfg.hidden_size):
        found.append(f"vocabulary {embedding[0]} x hidden {embedding[1]}")
        expected.append(f"vocabulary {cfg.vocab_size} x hidden {cfg.hidden_size}")
    proj = _by_suffix(shapes, "decoder.layers.self_attention.linear_proj.weight")
    if proj is not None and len(proj) == 3 and proj[0] != cfg.num_layers:
        found.append(f"{proj[0]} layers")
        expected.append(f"{cfg.num_layers} layers")
    router = _by_suffix(shapes, "decoder.layers.mlp.router.weight")
    if router is not None and len(router) == 3 and router[1] != cfg.num_experts:
        found.append(f"{router[1]} experts")
        expected.append(f"{cfg.num_experts} experts")
    if found:
        raise ConfigError(f"model.mcore_dir={directory} holds another architecture ({', '.join(found)}) than "
                          f"{source} ({', '.join(expected)}): point model.mcore_dir at this model's conversion")


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


def before_start(config: TrainConfig, *, local_run: bool) -> None:
    """Every check above; `local_run`: `mpo train` is about to start this node's ranks and engines (check-config
    reads no tokenizer: it may check a config before the model is in place)."""
    check_checkpoint_architecture(config)
    if local_run:
        check_tokenizer_fits(config)
        check_local_engines_can_start(config)
        check_engine_urls_answer(config)
