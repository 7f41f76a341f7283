"""The `gateway` agent loop runs a user program per sample and turns its session into a trajectory:
the program's reward (or the reward function's on the final conversation when it gives none), a
command with the URL in its environment, a program that fails, and a worker pause that does not wait
for a program between calls (its calls only take longer)."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import openai
import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.loop import (
    GatewayAgentLoop,
    ProgramError,
    ProgramResult,
    close_gateway,
    gateway_metrics,
    gateway_server,
)
from streamrl.rollout.types import AgentState, FinishReason, TrajectoryStatus
from streamrl.rollout.worker import RolloutWorker
from tests.rollout.gateway.conftest import CALC_TOOL, gateway_ctx, new_data
from tests.rollout.test_agent_loop import ANSWER, CALL, turn_script

pytestmark = pytest.mark.timeout(60)

HERE = "tests.rollout.gateway.test_loop"
GATES: dict[str, asyncio.Event] = {}


async def tool_program(base_url: str, api_key: str, sample: dict) -> float:
    """An ordinary OpenAI-SDK agent: call, run the tool it asks for, call again; reward 0.5 if right."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = list(sample["messages"])
    out = await client.chat.completions.create(model="any", messages=messages, tools=[CALC_TOOL])
    msg = out.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "84"})
    out = await client.chat.completions.create(model="any", messages=messages, tools=[CALC_TOOL])
    return 0.5 if "84" in (out.choices[0].message.content or "") else 0.0


async def no_reward_program(base_url: str, api_key: str, sample: dict) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    await client.chat.completions.create(model="any", messages=sample["messages"])


async def reporting_program(base_url: str, api_key: str, sample: dict) -> ProgramResult:
    """Calls once and reports how it ended beside its reward, as an in-process harness would."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    await client.chat.completions.create(model="any", messages=sample["messages"])
    return ProgramResult(reward=0.25, metrics={"exit_submitted": 1, "model_calls": 1})


def bad_metrics_program(base_url: str, api_key: str, sample: dict) -> ProgramResult:
    """A sync program whose numbers break the rules: ignored, and its reward (None) still stands."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    client.chat.completions.create(model="any", messages=sample["messages"])
    return ProgramResult(metrics={"Model Calls": float("nan")})


async def failing_program(base_url: str, api_key: str, sample: dict) -> float:
    raise RuntimeError("the agent crashed")


async def gated_program(base_url: str, api_key: str, sample: dict) -> float:
    """Calls, then waits for the test (thinking, running tools), then calls again."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = list(sample["messages"])
    out = await client.chat.completions.create(model="any", messages=messages)
    GATES["called"].set()
    await GATES["go"].wait()
    messages += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="any", messages=messages)
    return 1.0


def loop_ctx(tokenizer, turns, **gateway):
    script, turn_ids = turn_script(tokenizer, turns)
    return gateway_ctx(tokenizer, FakeEngine(script=script), gateway=GatewayConfig(**gateway)), turn_ids


async def test_the_program_reward_and_its_session_make_the_trajectory(tiny_tokenizer):
    ctx, turn_ids = loop_ctx(tiny_tokenizer, [CALL, ANSWER], program=f"{HERE}:tool_program")
    try:
        traj = await GatewayAgentLoop(ctx).run(new_data())
    finally:
        await close_gateway(ctx)
    traj.validate()
    assert traj.status is TrajectoryStatus.FINISHED and traj.agent_name == "gateway"
    assert traj.reward == 0.5 and traj.finish_reason is FinishReason.STOP
    obs = [t for t, m in zip(traj.response_ids, traj.response_mask) if not m]
    assert traj.response_ids == turn_ids[0] + obs + turn_ids[1] and obs
    assert traj.num_turns == 3  # two assistant turns, one tool turn (as the tool loop counts)


async def test_without_a_program_reward_the_reward_fn_scores_the_final_conversation(tiny_tokenizer):
    ctx, _ = loop_ctx(tiny_tokenizer, [ANSWER], program=f"{HERE}:no_reward_program")
    data = new_data()
    try:
        traj = await GatewayAgentLoop(ctx).run(data)
    finally:
        await close_gateway(ctx)
    assert traj.status is TrajectoryStatus.FINISHED and traj.reward == 1.0  # math_answer: \boxed{84} == 84
    assert data.messages[-1] == {"role": "assistant", "content": ANSWER}
    assert data.state is AgentState.TERMINATED and data.gateway["num_calls"] == 1


async def test_an_in_process_programs_result_gives_its_reward_and_named_numbers(tiny_tokenizer, caplog):
    ctx, _ = loop_ctx(tiny_tokenizer, [ANSWER, ANSWER], program=f"{HERE}:reporting_program")
    try:
        traj = await GatewayAgentLoop(ctx).run(new_data())
        metrics = gateway_metrics(ctx)
    finally:
        await close_gateway(ctx)
    assert traj.status is TrajectoryStatus.FINISHED and traj.reward == 0.25
    assert metrics["rollout/program/num_samples"] == 1.0
    assert metrics["rollout/program/exit_submitted/sum"] == 1.0 and metrics["rollout/program/model_calls/sum"] == 1.0

    ctx, _ = loop_ctx(tiny_tokenizer, [ANSWER], program=f"{HERE}:bad_metrics_program")
    try:
        traj = await GatewayAgentLoop(ctx).run(new_data())
        metrics = gateway_metrics(ctx)
    finally:
        await close_gateway(ctx)
    assert traj.status is TrajectoryStatus.FINISHED and traj.reward == 1.0  # the reward_fn's: the program gave none
    assert not [k for k in metrics if k.startswith("rollout/program/")]  # nothing counted
    assert any("bad_metrics_program" in r.getMessage() and "is not" in r.getMessage() for r in caplog.records)


async def test_a_command_program_gets_the_url_and_prints_its_reward(tiny_tokenizer):
    script = textwrap.dedent(
        """
        import json, os, urllib.request
        sample = json.loads(os.environ["STREAMRL_SAMPLE"])
        body = json.dumps({"model": "any", "messages": sample["messages"]}).encode()
        req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
            headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
        answer = json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
        print("agent log line")
        print(0.25 if "84" in answer else 0.0)
        """
    )
    ctx, turn_ids = loop_ctx(tiny_tokenizer, [ANSWER], command=[sys.executable, "-c", script])
    try:
        traj = await asyncio.wait_for(GatewayAgentLoop(ctx).run(new_data()), 30)
    finally:
        await close_gateway(ctx)
    assert traj.status is TrajectoryStatus.FINISHED and traj.reward == 0.25
    assert traj.response_ids == turn_ids[0]


def collecting_worker(ctx) -> tuple[RolloutWorker, list]:
    """A rollout worker whose sink collects the rows it appends."""
    rows: list = []

    async def sink(traj):
        rows.append(traj)

    return RolloutWorker(ctx, sink), rows


async def test_a_failing_program_fails_the_trajectory(tiny_tokenizer):
    ctx, _ = loop_ctx(tiny_tokenizer, [ANSWER], program=f"{HERE}:failing_program")
    worker, rows = collecting_worker(ctx)
    try:
        worker.submit(new_data())
        await worker.wait_idle(10)
        with pytest.raises(RuntimeError, match="the agent crashed"):
            await GatewayAgentLoop(ctx).run(new_data("g0/1"))
        ctx.cfg.gateway = GatewayConfig(program=f"{HERE}:no_reward_program", timeout_s=0.001)
        with pytest.raises(ProgramError, match="did not return"):
            await GatewayAgentLoop(ctx).run(new_data("g0/2"))
    finally:
        await close_gateway(ctx)
    assert [r.status for r in rows] == [TrajectoryStatus.FAILED] and worker.num_failed == 1


async def test_a_worker_pause_does_not_wait_for_a_program_between_calls(tiny_tokenizer):
    GATES.update(called=asyncio.Event(), go=asyncio.Event())
    ctx, _ = loop_ctx(tiny_tokenizer, ["The answer is 84.", "Yes, \\boxed{84}."], program=f"{HERE}:gated_program")
    worker, rows = collecting_worker(ctx)
    try:
        worker.submit(new_data())
        await asyncio.wait_for(GATES["called"].wait(), 10)
        await asyncio.wait_for(worker.pause(timeout_s=5), 2)  # the program holds no engine request
        await ctx.server.set_policy_version(1)
        GATES["go"].set()  # its next call arrives during the sync and waits
        await asyncio.sleep(0.05)
        assert ctx.num_in_engine == 0 and rows == []
        await worker.resume()
        await worker.wait_idle(10)
    finally:
        await close_gateway(ctx)
    (traj,) = rows
    assert traj.status is TrajectoryStatus.FINISHED and traj.reward == 1.0
    assert sorted({v for v, m in zip(traj.policy_versions, traj.response_mask) if m}) == [0, 1]


async def test_the_server_is_the_contexts_own_started_once(tiny_tokenizer):
    ctx, other = (gateway_ctx(tiny_tokenizer, FakeEngine()) for _ in range(2))
    assert gateway_metrics(ctx) == {}
    servers = await asyncio.gather(*(gateway_server(ctx, ctx.cfg.gateway) for _ in range(3)))
    try:
        assert servers[0] is servers[1] is servers[2] is ctx.gateway and ctx.gateway.port is not None
        assert other.gateway is None and gateway_metrics(other) == {}  # another worker's context has none
        assert gateway_metrics(ctx)["rollout/gateway/num_sessions"] == 0.0
    finally:
        await close_gateway(ctx)
    assert ctx.gateway is None and gateway_metrics(ctx) == {}
