"""Reward shaping by response length."""

from __future__ import annotations


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (DAPO, arXiv 2503.14476), added to the task reward.

    0 while ``length <= max_len - buffer``; inside the last `buffer` tokens it falls linearly,
    ``((max_len - buffer) - length) / buffer``, reaching -1 at ``length == max_len``; -1 beyond. DAPO used
    max_len 20480 and buffer 4096.
    """
    if buffer < 1 or buffer > max_len:
        raise ValueError(f"overlong buffer={buffer} must be in 1..max_len ({max_len})")
    free = max_len - buffer
    if length <= free:
        return 0.0
    if length <= max_len:
        return (free - length) / buffer
    return -1.0
