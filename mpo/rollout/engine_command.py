"""The one builder of an engine's command line and environment.

The launcher (launch/plan.py) and the trainer's local EngineSet (mpo/rollout/engines.py via
mpo.rollout.local_engine) both start engines; both call `engine_command`, so dtype, seed, checkpoint, routed
experts and the key cannot drift between them.

The API key never goes on the command line (any user on the node can read argv with `ps`): it travels in the
environment variable `MPO_API_KEY` (readable only by the process's owner). mpo's engine reads it there; SGLang has
no such variable, so its command is a short `python -c` launcher that appends `--api-key` to SGLang's in-process
`sys.argv` (which `ps` does not show) and then runs `sglang.launch_server` as `python -m` would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mpo.config import served_dtype

if TYPE_CHECKING:
    from mpo.config import ModelSection, RolloutSection, SyncSection

API_KEY_ENV = "MPO_API_KEY"
SECRET_ENV = frozenset({API_KEY_ENV})  # environment variables never printed (dry runs, messages) ...
REDACTED = "<redacted>"  # ... but shown as this

# The module docstring's launcher. Imports only the standard library: SGLang's (separate) environment has no mpo.
SGLANG_KEY_LAUNCHER = (
    'import os, runpy, sys; '
    f'key = os.environ.get("{API_KEY_ENV}"); '
    'sys.argv += ["--api-key", key] if key else []; '
    'runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)'
)


@dataclass(frozen=True)
class EngineSettings:
    """What an engine serves, independent of where it runs: the config fields an engine depends on (from_config names
    each; `dtype` is rollout.engine_dtype, else model.dtype). mpo's engine only: `seed` (its init without a checkpoint:
    config.seed, so it starts as the trainer does), `preset`, `mcore_dir` (loaded when there is no hf_dir; None: seeded
    init) and `max_batch` (its largest decode batch); it runs at TP1. `bucket_mb`: mpo's engine accepts request bodies
    of a bucket after base64 plus headroom (--max-body-mb). `memory_saver` (rollout.colocate): SGLang gets
    --enable-memory-saver to release and resume its GPU memory (mpo's engine serves the same endpoints without a flag).
    `mem_fraction`: SGLang's --mem-fraction-static (None: its default). `await_weights` (every run's engines: the
    trainer publishes its weights before the first rollout): mpo's engine starts from a random init instead of building
    the trainer's (`seed`, `mcore_dir`), which the first sync would overwrite; it then does not import megatron-core."""

    engine: Literal["mpo", "sglang"] = "mpo"
    dtype: Literal["fp32", "bf16"] = "fp32"
    fp32_lm_head: bool = True
    seed: int = 1234
    preset: str = "tiny"
    hf_dir: str | None = None
    mcore_dir: str | None = None
    tensor_parallel: int = 1
    api_key: str | None = None
    max_batch: int = 256
    mem_fraction: float | None = None
    bucket_mb: int = 64
    memory_saver: bool = False
    await_weights: bool = False

    @property
    def max_body_mb(self) -> int:
        """A bucket base64-encoded (x4/3) with 50% headroom for the JSON around it, at least the engine's 256."""
        return max(256, -(-self.bucket_mb * 2))

    @classmethod
    def from_config(cls, m: ModelSection, r: RolloutSection, sync: SyncSection, *, seed: int,
                    mem_fraction: float | None = None) -> EngineSettings:
        return cls(engine=r.engine, dtype=served_dtype(m, r), fp32_lm_head=m.fp32_lm_head, seed=seed,
                   preset=m.preset, hf_dir=m.hf_dir, mcore_dir=m.mcore_dir,
                   tensor_parallel=r.tensor_parallel if r.engine == "sglang" else 1, api_key=r.api_key,
                   mem_fraction=mem_fraction, bucket_mb=sync.bucket_mb, memory_saver=r.colocate, await_weights=True)


@dataclass(frozen=True)
class EngineCommand:
    """An engine's exact command line and the environment variables it needs on top of its parent's."""

    argv: tuple[str, ...]  # never holds the key
    env: dict[str, str] = field(default_factory=dict)  # MPO_API_KEY when a key is set
    host: str = "127.0.0.1"  # the address the engine binds
    port: int = 0  # its HTTP port


def engine_command(settings: EngineSettings, *, python: str, host: str, port: int) -> EngineCommand:
    """The server command of one engine: SGLang (GPUs) or mpo's own engine (CPU).

    Both get routed-experts capture unconditionally (not only for replay=r3): the trainer compares engine and trainer
    routing every step (routing/rollout_vs_old/* metrics). mpo's engine also gets --exit-with-parent: whoever
    started it (a launch agent, a trainer rank, a test) takes it down by dying, even by SIGKILL.
    """
    s = settings
    env = {API_KEY_ENV: s.api_key} if s.api_key else {}
    if s.engine == "sglang":
        if not s.hf_dir:
            raise ValueError("rollout.engine='sglang' needs model.hf_dir (the checkpoint SGLang loads)")
        entry = ["-c", SGLANG_KEY_LAUNCHER] if s.api_key else ["-m", "sglang.launch_server"]
        argv = [python, *entry, "--model-path", s.hf_dir, "--tp", str(s.tensor_parallel), "--host", host,
                "--port", str(port), "--dtype", "bfloat16" if s.dtype == "bf16" else "float32",
                "--enable-return-routed-experts"]
        if s.fp32_lm_head:
            argv.append("--enable-fp32-lm-head")
        if s.mem_fraction is not None:
            argv += ["--mem-fraction-static", str(s.mem_fraction)]
        if s.memory_saver:
            argv.append("--enable-memory-saver")
        return EngineCommand(tuple(argv), env, host, port)
    argv = [python, "-m", "mpo.engine", "--host", host, "--port", str(port), "--preset", s.preset,
            "--dtype", s.dtype, "--max-batch", str(s.max_batch), "--enable-return-routed-experts",
            "--fp32-lm-head" if s.fp32_lm_head else "--no-fp32-lm-head", "--seed", str(s.seed),
            "--max-body-mb", str(s.max_body_mb)]
    if s.hf_dir:  # the same checkpoint SGLang would load
        argv += ["--model-path", s.hf_dir]
    elif s.await_weights:
        argv.append("--await-weights")
    elif s.mcore_dir:
        argv += ["--mcore-dir", s.mcore_dir]
    argv.append("--exit-with-parent")
    return EngineCommand(tuple(argv), env, host, port)
