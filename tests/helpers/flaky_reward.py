"""A reward plug-in (`reward.fn=flaky_reward:score`) that misbehaves on purpose: for some completions it raises, for
others it hangs far past reward.timeout_s; the rest are scored by reasoning-gym's own scorer. Used to show that a
broken verifier costs its samples a 0 and a count in reward_errors, never the run."""

from __future__ import annotations

import time
import zlib

from mpo.rewards import get_reward


def score(completion: str, answer, metadata: dict) -> float:
    kind = zlib.crc32(completion.encode()) % 4
    if kind == 0:
        raise RuntimeError("verifier bug")
    if kind == 1:
        time.sleep(3600)
    return get_reward("reasoning_gym")(completion, answer, metadata)
