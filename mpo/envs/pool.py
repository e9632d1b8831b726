"""Environments in worker processes: the reward pool's machinery (mpo.rewards.pool: timeouts, crash containment,
memory caps, bounded stderr) running mpo.envs._worker. One call per live episode and turn; a call that raises, hangs
past `timeout_s` or kills its worker fails that episode alone."""

from __future__ import annotations

from mpo.rewards.pool import RewardPool

from .registry import get_env_class


class EnvPool(RewardPool):
    """`workers` processes running environment `name` (registered or ``module:Class``).

    reset(rows) -> batch with results (state, messages); step(states, texts) -> batch with results (state,
    messages, reward, done). A failed call's result is None (its index in batch.failed; a few messages in
    last_errors)."""

    worker_module = "mpo.envs._worker"
    kind = "environment"

    @staticmethod
    def _check_name(fn_name: str) -> None:
        get_env_class(fn_name)

    def reset(self, rows: list[dict]):
        return self.run([("reset", row) for row in rows], None)

    def step(self, states: list[bytes], texts: list[str]):
        return self.run([("step", state, text) for state, text in zip(states, texts, strict=True)], None)
