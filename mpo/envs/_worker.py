"""An EnvPool worker process: ``python -m mpo.envs._worker NAME PARENT_PID MAX_MEMORY_MB [MAX_STATE_BYTES]``.

The reward worker's protocol and containment (mpo.rewards._worker.serve) with an environment instead of a reward
function. Calls: ("reset", row) -> (state, opening messages); ("step", state, assistant_text) -> (state, observation
messages, reward, done). `state` is the pickled environment: it travels through the trainer between turns, so any
worker can run an episode's next turn, and rank 0 holds one per live episode; a state over MAX_STATE_BYTES
(rollout.max_env_state_bytes) fails its call, and so its episode, here. Everything returned is checked here and made
plain data (str dicts, a float, a bool): what the parent unpickles is never the environment's own objects. Message
text gets the data rows' check (mpo.data.sources): a string that is not valid UTF-8 text (a lone surrogate) would
fail in the tokenizer. The pool checks all of this again on receipt (mpo.envs.pool), with the same functions.
"""

from __future__ import annotations

import pickle
import sys

from mpo.data.sources import DataError, _check_text
from mpo.envs.registry import get_env_class
from mpo.rewards._worker import check_reward, serve

MAX_MESSAGE_CHARS = 1 << 20  # of one call's messages (roles and contents): an environment's answer is not a document
MAX_MESSAGES = 64
DEFAULT_MAX_STATE_BYTES = 1 << 20  # rollout.max_env_state_bytes's default (its docstring says why)
_max_state_bytes = DEFAULT_MAX_STATE_BYTES  # this worker's cap, from its command line


def check_state(state: bytes, max_state_bytes: int) -> bytes:
    """`state` (a pickled environment) if it is within the cap; else ValueError naming the setting."""
    if len(state) > max_state_bytes:
        raise ValueError(f"the environment's state pickles to {len(state)} bytes, over "
                         f"rollout.max_env_state_bytes={max_state_bytes}")
    return state


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
        chars += len(role) + len(content)
        if chars > MAX_MESSAGE_CHARS:
            raise ValueError(f"{where} returned over {MAX_MESSAGE_CHARS} characters")
        try:  # as a data row's messages are checked
            _check_text(role, where, f"[{i}] 'role'")
            _check_text(content, where, f"[{i}] 'content'")
        except DataError as e:
            raise ValueError(str(e)) from None
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


def check_reset(messages) -> list[dict]:
    messages = check_messages(messages, "reset()")
    if not messages:
        raise ValueError("reset() returned no messages")
    return messages


def _handle(cls: type, op: str, *args):
    if op == "reset":
        (row,) = args
        env = cls(row)
        messages = check_reset(env.reset())
        state = check_state(pickle.dumps(env, protocol=pickle.HIGHEST_PROTOCOL), _max_state_bytes)
        return state, messages
    if op == "step":
        state, text = args
        env = pickle.loads(state)
        messages, reward, done = check_step(env.step(text))
        state = check_state(pickle.dumps(env, protocol=pickle.HIGHEST_PROTOCOL), _max_state_bytes)
        return state, messages, reward, done
    raise ValueError(f"unknown environment call {op!r}")


if __name__ == "__main__":
    if len(sys.argv) > 4:
        _max_state_bytes = int(sys.argv[4])
    serve(sys.argv[1:4], get_env_class, _handle)
