"""What the example verifiers environments share: arithmetic questions, a calculator, the answer check.

The environments beside this file (`vf_arith_single`, `vf_arith_tools`, `vf_arith_stateful`) are plain
verifiers environments, each a module exposing `load_environment`. They run in the environment's own
virtual environment (docs/verifiers.md), so they import only the standard library, `datasets` and
`verifiers`, never streamrl.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable

from datasets import Dataset  # pyrefly: ignore[missing-import]

SYSTEM_PROMPT = "Solve the arithmetic problem. Give the final answer as \\boxed{NUMBER}."
TOOL_SYSTEM_PROMPT = (
    "Solve the arithmetic problem. Use the calculator tool for every arithmetic step, then give the final "
    "answer as \\boxed{NUMBER}."
)
_OPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}
_BOXED = re.compile(r"\\boxed\{\s*(-?[\d,]+)\s*\}")


def make_dataset(num_examples: int, seed: int) -> Dataset:
    """`num_examples` questions `a op b op c` with integer answers (columns `question`, `answer`)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(10, 99)
        op = rng.choice(["+", "-"])
        expression = f"{a} * {b} {op} {c}"
        rows.append({"question": f"What is {expression}?", "answer": str(calculate(expression))})
    return Dataset.from_list(rows)


def calculate(expression: str) -> int:
    """Evaluate integers with + - * // and parentheses (no names, no calls)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return walk(ast.parse(expression, mode="eval"))


def boxed_answer(text: str) -> str | None:
    """The last \\boxed{N} of a text, digits only."""
    found = _BOXED.findall(text or "")
    return found[-1].replace(",", "") if found else None


def correct_answer(parser, completion, answer) -> float:
    """1.0 when the last assistant message's boxed number is the answer."""
    return 1.0 if parser.parse_answer(completion) == str(answer) else 0.0
