"""An EnvPool worker process: ``python -m mpo.envs._worker NAME PARENT_PID [MAX_MEMORY_MB]``.

The reward worker's protocol and containment (mpo.rewards._worker.serve) with an environment instead of a reward
function. Calls: ("reset", row) -> (state, opening messages); ("step", state, assistant_text) -> (state, observation
messages, reward, done). `state` is the pickled environment: it travels through the trainer between turns, so any
worker can run an episode's next turn. Everything returned is checked here and made plain data (str dicts, a float,
a bool): what the parent unpickles is never the environment's own objects.
"""

from __future__ import annotations

import pickle
import sys

from mpo.rewards._worker import check_reward, serve

MAX_MESSAGE_CHARS = 1 << 20  # of one observation's text: an environment's answer is not a document dump
MAX_MESSAGES = 64


def check_messages(value, where: str) -> list[dict]:
    """`value` as a list of {"role": str, "content": str}; ValueError naming what is wrong."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must return a list of messages, got {type(value).__name__}")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"{where} returned {len(value)} messages (at most {MAX_MESSAGES})")
    out, chars = [], 0
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"{where}[{i}] must be a dict with role and content, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if type(role) is not str or not role or type(content) is not str:
            raise ValueError(f"{where}[{i}] must have a non-empty string 'role' and a string 'content'")
        chars += len(content)
        if chars > MAX_MESSAGE_CHARS:
            raise ValueError(f"{where} returned over {MAX_MESSAGE_CHARS} characters")
        out.append({"role": str(role), "content": str(content)})
    return out


def check_step(value) -> tuple[list[dict], float, bool]:
    if not isinstance(value, tuple) or len(value) != 3:
        raise ValueError(f"step() must return (messages, reward, done), got {type(value).__name__}")
    messages, reward, done = value
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"step() reward must be a number, got {type(reward).__name__}")
    if not isinstance(done, bool):
        raise ValueError(f"step() done must be True or False, got {type(done).__name__}")
    return check_messages(messages, "step()"), check_reward(float(reward)), bool(done)


def _load(name: str) -> type:
    from mpo.envs.registry import get_env_class

    return get_env_class(name)


def _handle(cls: type, op: str, *args):
    if op == "reset":
        (row,) = args
        env = cls(row)
        messages = check_messages(env.reset(), "reset()")
        if not messages:
            raise ValueError("reset() returned no messages")
        return pickle.dumps(env, protocol=pickle.HIGHEST_PROTOCOL), messages
    if op == "step":
        state, text = args
        env = pickle.loads(state)
        messages, reward, done = check_step(env.step(text))
        return pickle.dumps(env, protocol=pickle.HIGHEST_PROTOCOL), messages, reward, done
    raise ValueError(f"unknown environment call {op!r}")


if __name__ == "__main__":
    serve(sys.argv[1:], _load, _handle)
