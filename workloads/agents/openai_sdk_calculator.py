"""A function-tool calculator agent built on the OpenAI Agents SDK (`openai-agents`).

Why this framework: it is a widely used agent framework whose model layer speaks plain chat
completions (`OpenAIChatCompletionsModel` over an `AsyncOpenAI` client with our `base_url`), whose
tools are ordinary Python functions (`@function_tool`, JSON schema from the signature) and whose runner
owns the whole loop (call the model, run the tools it asked for, feed the results back, stop at a
final answer). Nothing in it is written for streamrl: it is trained exactly as a user would write it.

Tracing is switched off (`set_tracing_disabled`): the SDK would otherwise upload traces to OpenAI, and
a training run must not reach the network.

The program grades nothing itself: it returns None and the run's `reward_fn` scores the final
conversation against the sample's ground truth, as for the built-in loops. An agent that breaks the
framework's rules (a call of an unknown tool, too many turns) gets 0.0, like a wrong answer. Errors of
the API itself (the gateway's refusal of an over-long conversation) propagate: the gateway loop
finishes such a trajectory with finish reason `length`.
"""

from __future__ import annotations

from typing import Any, cast

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    OpenAIChatCompletionsModel,
    Runner,
    TResponseInputItem,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from streamrl.tools.calculator import CalculatorError, evaluate_expression, format_number

set_tracing_disabled(True)

MAX_TURNS = 4  # model calls per sample: room for a tool call or two and the answer


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers and + - * / // % ** and parentheses).

    Args:
        expression: the expression, e.g. "1234 * 5678".
    """
    try:
        return format_number(evaluate_expression(expression))
    except CalculatorError as exc:
        return f"error: {exc}"


def build_agent(base_url: str, api_key: str) -> Agent:
    """The agent, its model served at `base_url` (the gateway session's URL)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    return Agent(
        name="calculator",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        tools=[calculator],
    )


async def run(base_url: str, api_key: str, sample: dict[str, Any]) -> float | None:
    """One episode on `sample` (its `messages` are the dataset prompt); None: the reward_fn scores it."""
    agent = build_agent(base_url, api_key)
    # The dataset's chat messages as the SDK's input items (role + content: its "easy input message").
    prompt = cast(list[TResponseInputItem], [{"role": m["role"], "content": m["content"]} for m in sample["messages"]])
    try:
        await Runner.run(agent, prompt, max_turns=MAX_TURNS)
    except (MaxTurnsExceeded, ModelBehaviorError):
        return 0.0
    return None
