"""A `StatefulToolEnv`: a calculator whose results the environment keeps in the rollout's state.

The tool's `results` argument is hidden from the model and injected from the state
(`update_tool_args`); the rubric pays for the right boxed number (weight 1) and, from the state, for
an answer the calculator actually produced (weight 0.5).

    streamrl: [rollout.agent.verifiers] environment = "vf_arith_stateful", paths = ["workloads/verifiers_envs"]
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


def calculator(expression: str, results: list) -> str:
    """Evaluate an arithmetic expression of integers with + - * // and parentheses.

    Args:
        expression: the expression, e.g. "37 * 4 + 12"
        results: the rollout's earlier results (filled in by the environment)
    """
    value = str(calculate(expression))
    results.append(value)
    return value


def answer_from_calculator(parser, completion, state) -> float:
    """1.0 when the boxed answer is a number the calculator returned in this rollout."""
    answer = parser.parse_answer(completion)
    return 1.0 if answer is not None and answer in state.get("calculator_results", []) else 0.0


class CalculatorStateEnv(vf.StatefulToolEnv):
    def __init__(self, **kwargs):
        super().__init__(tools=[], **kwargs)
        self.add_tool(calculator, args_to_skip=["results"])

    async def setup_state(self, state):
        state["calculator_results"] = []
        return await super().setup_state(state)

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
        if tool_name == "calculator":
            tool_args["results"] = state["calculator_results"]
        return tool_args


def load_environment(num_train: int = 64, num_eval: int = 16, seed: int = 0, max_turns: int = 4) -> vf.Environment:
    parser = vf.Parser(extract_fn=boxed_answer)
    rubric = vf.Rubric(funcs=[correct_answer, answer_from_calculator], weights=[1.0, 0.5], parser=parser)
    return CalculatorStateEnv(
        dataset=make_dataset(num_train, seed),
        eval_dataset=make_dataset(num_eval, seed + 1),
        system_prompt=TOOL_SYSTEM_PROMPT,
        parser=parser,
        rubric=rubric,
        max_turns=max_turns,
    )
