"""Environments for the multi-turn tests (`rollout.env=helpers.scripted_env:...`).

ScriptedEnv: two turns with a known observation: turn 1 is answered by a tool message "RESULT 42" (reward 0.25),
turn 2 ends the episode (reward 0.5), whatever the model wrote. It records the texts it was given.
FlakyEnv: by the row's "mode" (or, for mode "hash", by a hash of the assistant text): raises, hangs, returns
garbage, kills its own process, or behaves as ScriptedEnv.
"""

from __future__ import annotations

import os
import time
import zlib

OBSERVATION = [{"role": "tool", "content": "RESULT 42"}]


class ScriptedEnv:
    def __init__(self, row: dict) -> None:
        self.question = row.get("prompt", "?")
        self.turn = 0
        self.texts: list[str] = []

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.question}]

    def step(self, text: str):
        self.turn += 1
        self.texts.append(text)
        if self.turn == 1:
            return list(OBSERVATION), 0.25, False
        return [], 0.5, True


class FlakyEnv(ScriptedEnv):
    def __init__(self, row: dict) -> None:
        super().__init__(row)
        self.mode = row.get("mode", "hash")
        if self.mode == "raise_init":
            raise RuntimeError("environment bug in __init__")

    def step(self, text: str):
        mode = self.mode
        if mode == "hash":
            mode = ("raise", "hang", "garbage", "ok", "ok", "ok")[zlib.crc32(text.encode()) % 6]
        if mode == "raise":
            raise RuntimeError("environment bug")
        if mode == "hang":
            time.sleep(3600)
        if mode == "garbage":
            return "not a tuple"
        if mode == "garbage_messages":
            return [{"role": "tool", "content": 42}], 1.0, False
        if mode == "nan":
            return [], float("nan"), True
        if mode == "crash":
            os._exit(3)
        return super().step(text)


class BrokenEnv(ScriptedEnv):
    """Every episode fails at construction: no turn is ever generated."""

    def __init__(self, row: dict) -> None:
        raise RuntimeError("environment bug in __init__")
