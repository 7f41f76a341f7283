"""A `ToolEnv`: the model may call a calculator tool before it answers, scored by its boxed number.

streamrl: [rollout.agent.verifiers] environment = "vf_arith_tools", paths = ["workloads/verifiers_envs"]
"""

from __future__ import annotations

import verifiers as vf  # pyrefly: ignore[missing-import]
from vf_arith_common import (  # pyrefly: ignore[missing-import]
    TOOL_SYSTEM_PROMPT,
    boxed_answer,
    calculate,
    correct_answer,
    make_dataset,
)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * // and parentheses.

    Args:
        expression: the expression, e.g. "37 * 4 + 12"
    """
    return str(calculate(expression))


def load_environment(num_train: int = 64, num_eval: int = 16, seed: int = 0, max_turns: int = 4) -> vf.Environment:
    parser = vf.Parser(extract_fn=boxed_answer)
    return vf.ToolEnv(
        dataset=make_dataset(num_train, seed),
        eval_dataset=make_dataset(num_eval, seed + 1),
        system_prompt=TOOL_SYSTEM_PROMPT,
        parser=parser,
        rubric=vf.Rubric(funcs=[correct_answer], parser=parser),
        tools=[calculator],
        max_turns=max_turns,
    )
