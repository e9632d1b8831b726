"""Environments in worker processes: the reward pool's machinery (mpo.rewards.pool: timeouts, crash containment,
memory caps, bounded stderr, frames read with a cap and a deadline) running mpo.envs._worker. One call per live
episode and turn; a call that raises, hangs past `timeout_s`, kills its worker or returns a state over
`max_state_bytes` fails that episode alone."""

from __future__ import annotations

from mpo.rewards.pool import DEFAULT_MAX_MEMORY_MB, RewardPool

from ._worker import DEFAULT_MAX_STATE_BYTES, MAX_MESSAGE_CHARS, check_reset, check_state, check_step
from .registry import get_env_class

# Beyond the state and the messages' text (at most 4 UTF-8 bytes a character), a frame holds pickle framing: the
# protocol tuple, up to MAX_MESSAGES dicts, an error message.
_FRAME_SLACK_BYTES = 64 << 10


class EnvPool(RewardPool):
    """`workers` processes running environment `name` (registered or ``module:Class``).

    reset(rows) -> batch with results (state, messages); step(states, texts) -> batch with results (state,
    messages, reward, done). A failed call's result is None (its index in batch.failed; a few messages in
    last_errors). `max_state_bytes` caps an environment's pickled state (rollout.max_env_state_bytes): rank 0 holds
    one per live episode between turns."""

    worker_module = "mpo.envs._worker"
    kind = "environment"

    def __init__(self, fn_name: str, *, timeout_s: float, workers: int,
                 max_memory_mb: int | None = DEFAULT_MAX_MEMORY_MB,
                 max_state_bytes: int = DEFAULT_MAX_STATE_BYTES) -> None:
        if type(max_state_bytes) is not int or max_state_bytes < 1:
            raise ValueError(f"environment max_state_bytes={max_state_bytes!r} must be an integer >= 1")
        self.max_state_bytes = max_state_bytes  # before the workers start: their command line carries it
        super().__init__(fn_name, timeout_s=timeout_s, workers=workers, max_memory_mb=max_memory_mb)

    @staticmethod
    def _check_name(fn_name: str) -> None:
        get_env_class(fn_name)

    def _max_frame_bytes(self) -> int:
        return self.max_state_bytes + 4 * MAX_MESSAGE_CHARS + _FRAME_SLACK_BYTES

    def _worker_args(self) -> list[str]:
        return [*super()._worker_args(), str(self.max_state_bytes)]

    def _check_value(self, value):
        # The worker's own checks, again on receipt: what the episode loop and the tokenizer get is what they allow.
        if not isinstance(value, tuple) or len(value) not in (2, 4) or type(value[0]) is not bytes:
            raise ValueError("not (state, messages) nor (state, messages, reward, done)")
        state = check_state(value[0], self.max_state_bytes)
        if len(value) == 2:
            return state, check_reset(value[1])
        return (state, *check_step(value[1:]))

    def reset(self, rows: list[dict]):
        return self.run([("reset", row) for row in rows], None)

    def step(self, states: list[bytes], texts: list[str]):
        return self.run([("step", state, text) for state, text in zip(states, texts, strict=True)], None)
