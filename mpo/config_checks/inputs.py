"""Checks that read what the config points at: data.task and its files, reward and environment plug-ins,
model.hf_dir's config.json (model_config) and model.mcore_dir's metadata."""

from __future__ import annotations

import json
from pathlib import Path

from mpo.config import ConfigError, TrainConfig, _show


def check_data(config: TrainConfig) -> None:
    """data.task names a toy task, a reasoning_gym task, or data files that exist; text tasks have a tokenizer and a
    reward function; DAPO's overlong buffer fits in the response budget."""
    from mpo.data.task_spec import TaskSpecError, parse_task

    d, m, a, r = config.data, config.model, config.algorithm, config.rollout
    try:
        spec = parse_task(d.task)
    except TaskSpecError as exc:
        raise ConfigError(f"data.task: {exc}") from None
    if spec.kind != "toy" and not (m.tokenizer_dir or m.hf_dir):
        raise ConfigError(f"data.task={_show(d.task)} is a text task: set model.hf_dir or model.tokenizer_dir (its "
                          f"tokenizer encodes the prompts and decodes the responses)")
    if spec.kind == "files":  # a file whose rows all miss a key fails here, not after every rank has started
        from mpo.data.sources import DataError, check_first_rows

        try:
            check_first_rows(d.task, prompt_key=d.prompt_key, answer_key=d.answer_key, max_row_bytes=d.max_row_bytes)
        except (DataError, OSError) as exc:
            raise ConfigError(f"data.task: {exc}") from None
    if config.reward.fn is not None:
        from mpo.rewards import get_reward

        try:
            get_reward(config.reward.fn)  # a plug-in's module is imported here, so a typo fails before any rank starts
        except ValueError as exc:
            raise ConfigError(f"reward.fn: {exc}") from None
    if config.eval.every and config.eval.task is not None:
        try:
            eval_spec = parse_task(config.eval.task)
        except TaskSpecError as exc:
            raise ConfigError(f"eval.task: {exc}") from None
        if (eval_spec.kind == "toy") != (spec.kind == "toy"):
            raise ConfigError(f"eval.task={_show(config.eval.task)} and data.task={_show(d.task)} must both be toy "
                              f"tasks or both text tasks (the evaluation is scored by the run's reward and tokenizer)")
    if r.env is not None:
        check_env(config, spec.kind)
    budget = config.response_tokens
    if a.overlong_buffer >= budget:
        raise ConfigError(f"algorithm.overlong_buffer={a.overlong_buffer} must be below data.max_response_tokens "
                          f"(or rollout.max_new_tokens) = {budget}")


def check_env(config: TrainConfig, task_kind: str) -> None:
    """rollout.env: an importable environment on a text task, which does the scoring itself."""
    r = config.rollout
    if config.reward.fn is not None:
        raise ConfigError(f"rollout.env={_show(r.env)} and reward.fn={_show(config.reward.fn)} are both set: the "
                          f"environment's step() rewards are the episode's reward; unset reward.fn")
    if task_kind == "toy":
        raise ConfigError(f"rollout.env={_show(r.env)} needs a text task (data.task: a jsonl/parquet file or "
                          f"reasoning_gym:<task>) and a chat template; got the toy task {_show(config.data.task)}")
    if config.eval.every:
        raise ConfigError(f"rollout.env={_show(r.env)} with eval.every={config.eval.every}: held-out evaluation "
                          f"scores single turns with a reward function; set eval.every=0")
    from mpo.envs import get_env_class

    try:
        get_env_class(r.env)  # a plug-in's module is imported here, so a typo fails before any rank starts
    except ValueError as exc:
        raise ConfigError(f"rollout.env: {exc}") from None


def check_mcore_dir(config: TrainConfig, model_cfg) -> None:
    """model.mcore_dir is a torch_dist checkpoint (a conversion, a trainer checkpoint's step directory, or a run
    directory: its newest, mpo.model_files) whose metadata loads safely (mpo.safe_load) before any rank starts, and
    holds the configured architecture (its embedding, layer and expert counts: another model's checkpoint failed
    deep in the load, as "corrupt or unreadable")."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mpo.model_files import NotACheckpoint, resolve_mcore_dir
    from mpo.safe_load import CheckpointFileError, read_dcp_metadata

    mcore_dir = config.model.mcore_dir
    try:
        directory = resolve_mcore_dir(mcore_dir)
    except NotACheckpoint as exc:
        raise ConfigError(f"model.mcore_dir={_show(mcore_dir)}: {str(exc).removeprefix(str(mcore_dir) + ': ')}") \
            from None
    try:
        metadata = read_dcp_metadata(directory / ".metadata")
    except CheckpointFileError as exc:
        raise ConfigError(f"model.mcore_dir: {exc}") from None
    shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def saved(suffix: str) -> tuple[int, ...] | None:  # keys end alike in a conversion and a trainer checkpoint
        return next((shape for key, shape in shapes.items() if key.endswith(suffix)), None)

    found, expected = [], []
    embedding = saved("embedding.word_embeddings.weight")
    if embedding is not None and embedding != (model_cfg.vocab_size, model_cfg.hidden_size):
        found.append(f"vocabulary {embedding[0]} x hidden {embedding[1]}")
        expected.append(f"vocabulary {model_cfg.vocab_size} x hidden {model_cfg.hidden_size}")
    proj = saved("decoder.layers.self_attention.linear_proj.weight")
    if proj is not None and len(proj) == 3 and proj[0] != model_cfg.num_layers:
        found.append(f"{proj[0]} layers")
        expected.append(f"{model_cfg.num_layers} layers")
    router = saved("decoder.layers.mlp.router.weight")
    if router is not None and len(router) == 3 and router[1] != model_cfg.num_experts:
        found.append(f"{router[1]} experts")
        expected.append(f"{model_cfg.num_experts} experts")
    if found:
        source = "model.hf_dir's config.json" if config.model.hf_dir else f"model.preset={config.model.preset}"
        raise ConfigError(f"model.mcore_dir={mcore_dir} holds another architecture ({', '.join(found)}) than "
                          f"{source} ({', '.join(expected)}): point model.mcore_dir at this model's conversion")


def model_config(config: TrainConfig):
    """The MoEModelConfig the run trains (from the HF config.json when model.hf_dir is set)."""
    from mpo.models.config import from_hf_config, preset

    if config.model.hf_dir:
        path = Path(config.model.hf_dir) / "config.json"
        try:
            return from_hf_config(json.loads(path.read_bytes().decode("utf-8")))
        except OSError:
            raise ConfigError(f"model.hf_dir: {path} not found") from None
        except UnicodeDecodeError:
            raise ConfigError(f"model.hf_dir: {path} is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model.hf_dir: {path} line {exc.lineno} column {exc.colno}: invalid JSON: "
                              f"{exc.msg}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"model.hf_dir: {path}: {exc}") from None
    return preset(config.model.preset)
