"""Multi-turn and tool-using rollouts: an environment protocol (`rollout.env`), run in worker processes.

An environment is a class built from one dataset row (its keys: prompt, answer, and the others):

    class MyEnv:
        def __init__(self, row: dict): ...
        def reset(self) -> list[dict]: ...        # the opening messages [{"role": ..., "content": ...}]
        def step(self, assistant_text: str) -> tuple[list[dict], float, bool]:
            ...                                    # (new messages, role tool or user; this turn's reward; done)

`rollout.env` names it: a registered name (`calculator`) or `module:Class`. Per row and sample mpo creates
`Class(row)`, renders `reset()`'s messages with the chat template (generation prompt included), then for up to
`rollout.max_turns` turns the engine generates one assistant turn (stop at EOS or `rollout.max_tokens_per_turn`) and
`step(text)` answers. The episode's reward is the sum of its turns' rewards (mpo.envs.rollout has the token
accounting). Environments run in worker processes (mpo.envs.pool): an environment that raises, hangs past
reward.timeout_s, crashes its worker or returns something that is not (list of messages, finite reward, bool) ends
its episode with reward 0, counted in env_errors; training goes on. Message text gets the data rows' check: a string
that is not valid UTF-8 text (a lone surrogate) fails its episode the same way.

Between turns an episode's environment lives as a pickle in the trainer (any worker can take its next turn, and a
killed worker costs only the episode it was running): the environment's state must pickle, to at most
rollout.max_env_state_bytes (1 MiB by default; a bigger state fails its episode), since rank 0 holds one per live
episode. Keep handles that do not pickle (sockets, subprocesses) and large resources out of it, or re-open them
lazily in step(). Whatever an environment starts is killed with its worker (mpo.rewards._worker).
"""

from .registry import ENV_REGISTRY, get_env_class

__all__ = ["ENV_REGISTRY", "get_env_class"]
