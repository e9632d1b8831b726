"""The shipped example environment: a product of two 3-digit numbers, with a calculator tool.

The model asks the tool with `<calc>123*456</calc>` (the tool answers in a `tool` message) and ends with
`Answer: N`. The final turn's answer is checked against the row's `answer` (reward 1.0 when right, else 0); a turn
with neither gets a `user` message saying how to proceed, so an episode lasts until an answer or rollout.max_turns.
Rows: {"prompt": "What is 123 * 456?", "answer": "56088"} (mpo/recipes/data/calculator.jsonl; write more with
`python -m mpo.envs.calculator OUT.jsonl N`).
"""

from __future__ import annotations

import ast
import operator
import re

SYSTEM = ("You can use a calculator: write <calc>EXPRESSION</calc> (numbers and + - * / only) and wait for its "
          "result. When you know the result, reply with 'Answer: N'.")
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_ANSWER = re.compile(r"Answer:\s*(-?[\d,]+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """+ - * / over numbers, evaluated from the syntax tree (no eval), bounded in size."""
    if len(expression) > 200:
        return "error: expression too long"

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * /")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


class CalculatorEnv:
    """A product question with a calculator tool (see the module doc)."""

    def __init__(self, row: dict) -> None:
        self.question = row["prompt"]
        self.answer = str(row["answer"]).strip()

    def reset(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.question}]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        answer = _ANSWER.search(text)
        if answer:
            return [], float(answer.group(1).replace(",", "") == self.answer), True
        call = _CALL.search(text)
        if call:
            return [{"role": "tool", "content": calculate(call.group(1))}], 0.0, False
        return [{"role": "user", "content": "Use <calc>EXPRESSION</calc>, or reply with 'Answer: N'."}], 0.0, False


def write_rows(path: str, count: int, seed: int = 0) -> None:
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            f.write(json.dumps({"prompt": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n")


if __name__ == "__main__":
    import sys

    write_rows(sys.argv[1], int(sys.argv[2]))
