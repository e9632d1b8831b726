"""Verifiable text rewards: a registry of reward functions, a process pool that scores with timeouts, and shaping.

Every reward has the signature ``fn(completion: str, answer, metadata: dict) -> float``. Built-ins: ``math``
(math-verify), ``reasoning_gym`` (the task's own scorer) and ``toy`` (exact string match); ``module:function`` names
a plug-in, imported by name (also inside the pool's workers).
"""

from .pool import RewardPool
from .registry import RewardFn, get_reward, register_reward, reward_names
from .shaping import overlong_penalty

__all__ = ["RewardFn", "RewardPool", "get_reward", "overlong_penalty", "register_reward", "reward_names"]
