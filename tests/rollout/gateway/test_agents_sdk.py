"""The OpenAI Agents SDK calculator agent (`workloads/agents/openai_sdk_calculator.py`) against the real
gateway server with a scripted engine: the SDK's own loop (model call, function tool, model call)
becomes one unforked token record; the program leaves the grading to the run's reward_fn, except for
an episode the framework itself aborts (0.0)."""

from __future__ import annotations

import pytest

from streamrl.workloads.agents import openai_sdk_calculator
from tests.rollout.test_agent_loop import ANSWER, CALL

pytestmark = pytest.mark.timeout(60)


def _sample(ground_truth: str) -> dict:
    return {"messages": [{"role": "user", "content": "What is 12 times 7?"}], "ground_truth": ground_truth}


async def test_the_sdk_agent_calls_its_tool_and_the_session_records_one_sequence(make_gateway, tiny_tokenizer):
    gw = await make_gateway([CALL, ANSWER])
    assert await openai_sdk_calculator.run(gw.base_url, gw.api_key, _sample("84")) is None
    state = gw.session.state
    assert (state.num_calls, state.num_forks, state.num_retries_answered) == (2, 0, 0)
    assert len(gw.engine.requests_seen) == 2
    gw.session.finish()
    data = gw.data
    # The tool's result (the SDK ran `calculator("12 * 7")`) is an observation between two sampled turns.
    assert [m["role"] for m in data.messages] == ["user", "assistant", "tool", "assistant"]
    assert data.num_tool_calls == 1  # the model's call, counted on the record as a built-in loop counts it
    assert data.messages[2]["content"] == "84"
    runs = [m for i, m in enumerate(data.response_mask) if i == 0 or m != data.response_mask[i - 1]]
    assert runs == [1, 0, 1]
    assert gw.server.num_errors == 0


async def test_a_call_of_an_unknown_tool_scores_zero_not_a_crash(make_gateway):
    bad = '<tool_call>\n{"name": "web_search", "arguments": {"q": "12 * 7"}}\n</tool_call>'
    gw = await make_gateway([bad, ANSWER])
    assert await openai_sdk_calculator.run(gw.base_url, gw.api_key, _sample("84")) == 0.0
