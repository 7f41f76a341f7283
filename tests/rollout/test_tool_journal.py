"""Invariant I5: a tool call's side effect happens at most once per trajectory, across a weight-sync
park, a worker's death mid-call and a resume from the durable snapshot in another process; tool
instances live for the whole trajectory; a failed trajectory still releases what it holds.

A "world" list stands for the outside world: every tool execution appends to it at its start, so a
duplicated call shows up as an extra entry. A "process change" is a fresh `AgentContext` with a fresh
tool registry resuming from the AgentData JSON that the snapshot hook (or a partial row) captured.
"""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.agent_loop import AgentContext, ToolAgentLoop
from streamrl.rollout.types import AgentData, AgentState, FinishReason, TrajectoryStatus
from streamrl.tools import ToolRegistry
from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.types import ToolCallStatus, ToolJournalEntry, ToolResult
from tests.rollout.test_agent_loop import ANSWER, make_ctx, new_data, turn_script

COUNT = '<tool_call>\n{"name": "counter", "arguments": {}}\n</tool_call>'
COUNT_BOTH = COUNT + '\n<tool_call>\n{"name": "icounter", "arguments": {}}\n</tool_call>'

pytestmark = pytest.mark.timeout(60)


class CounterTool(BaseTool):
    """Stateful, with a side effect: each execution appends its name to `world` (at its start) and
    bumps the instance's count; `calc_reward` is the count, so a reward shows whether the state
    survived. `gate`, when given, holds every execution after its side effect until it is set."""

    def __init__(self, world: list[str], gate: asyncio.Event | None = None, name: str = "counter") -> None:
        parameters = {"type": "object", "properties": {}}
        schema = {"function": {"name": name, "description": "Count.", "parameters": parameters}}
        super().__init__(tool_schema=schema)
        self.world = world
        self.gate = gate

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        return await super().create(instance_id, count=0, **kwargs)

    async def restore(self, instance_id: str, journal: list[ToolJournalEntry], **kwargs) -> str:
        instance_id = await self.create(instance_id, **kwargs)
        self.instance_state(instance_id)["count"] = len(journal)  # replay the recorded calls
        return instance_id

    async def execute(self, instance_id: str, parameters: dict) -> ToolExecution:
        self.world.append(self.name)
        if self.gate is not None:
            await self.gate.wait()
        state = self.instance_state(instance_id)
        state["count"] += 1
        return ToolExecution(text=f"count={state['count']}")

    async def calc_reward(self, instance_id: str) -> float:
        return float(self.instance_state(instance_id)["count"])


class IdempotentCounterTool(CounterTool):
    idempotent = True


def counter_ctx(tokenizer, turns: list[str], *tools: BaseTool) -> tuple[AgentContext, list[str]]:
    """A context whose tools are `tools`, and the AgentData JSONs its snapshot hook received."""
    script, _ = turn_script(tokenizer, turns)
    ctx = make_ctx(tokenizer, FakeEngine(script=script))
    ctx.tools = ToolRegistry(tools)
    snapshots: list[str] = []

    async def snapshot(data: AgentData) -> None:
        snapshots.append(data.to_json())

    ctx.snapshot = snapshot
    return ctx, snapshots


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.002)):
        if predicate():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not reached")


def observation_text(tokenizer, traj) -> str:
    return tokenizer.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if m == 0])


async def test_pause_mid_tool_runs_the_call_once_and_keeps_the_instance(tiny_tokenizer):
    turns = [COUNT, COUNT, ANSWER]
    ref_world: list[str] = []
    ref_ctx, _ = counter_ctx(tiny_tokenizer, turns, CounterTool(ref_world))
    reference = await ToolAgentLoop(ref_ctx).run(new_data())
    assert reference.reward == 1.0 + 2.0 and len(ref_world) == 2  # math_answer + calc_reward (2 calls)

    world: list[str] = []
    gate = asyncio.Event()
    tool = CounterTool(world, gate)
    ctx, snapshots = counter_ctx(tiny_tokenizer, turns, tool)
    task = asyncio.create_task(ToolAgentLoop(ctx).run(new_data()))
    await wait_until(lambda: len(world) == 1)  # the first call is running: a weight sync pauses now
    ctx.cancel.set()
    gate.set()
    partial = await task
    assert partial.status is TrajectoryStatus.PARTIAL
    parked = AgentData.from_json(partial.agent_data_json)
    assert parked.state is AgentState.GENERATING  # the tool finished, the loop parked at the engine
    assert [e.status for e in parked.tool_journal] == [ToolCallStatus.DONE]
    assert parked.tool_journal[0].result.text == "count=1"
    assert AgentData.from_json(snapshots[0]).tool_journal[0].status is ToolCallStatus.INTENT
    assert ctx.tools.num_sessions == 1 and tool.num_instances == 1  # the park keeps the instance

    ctx.cancel.clear()
    final = await ToolAgentLoop(ctx).run(parked)
    final.validate()
    assert final.status is TrajectoryStatus.FINISHED and final.num_tool_calls == 2
    assert world == ["counter", "counter"]  # each call's side effect once
    assert final.reward == reference.reward  # the instance state survived the park
    assert ctx.tools.num_sessions == 0 and tool.num_instances == 0  # released at the end


async def _die_mid_call(tokenizer, turns: list[str], *tools: CounterTool) -> AgentData:
    """Run until the first turn's calls are executing, then kill the loop (the worker dies); returns
    the intent snapshot, the only durable state of that turn."""
    ctx, snapshots = counter_ctx(tokenizer, turns, *tools)
    world = tools[0].world
    task = asyncio.create_task(ToolAgentLoop(ctx).run(new_data()))
    await wait_until(lambda: len(world) == len(tools))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ctx.tools.num_sessions == 0 and all(t.num_instances == 0 for t in tools)
    assert len(snapshots) == 1
    snap = AgentData.from_json(snapshots[0])
    assert snap.state is AgentState.PROCESSING_TOOLS
    assert [(e.name, e.status, e.result) for e in snap.tool_journal] == [
        (t.name, ToolCallStatus.INTENT, None) for t in tools
    ]
    return snap


async def test_non_idempotent_call_in_doubt_is_not_rerun_after_a_process_change(tiny_tokenizer):
    world: list[str] = []
    snap = await _die_mid_call(tiny_tokenizer, [COUNT, ANSWER], CounterTool(world, asyncio.Event()))
    ctx, snapshots = counter_ctx(tiny_tokenizer, [COUNT, ANSWER], CounterTool(world))  # another process
    final = await ToolAgentLoop(ctx).run(snap)
    final.validate()
    assert final.status is TrajectoryStatus.FINISHED and final.finish_reason is FinishReason.STOP
    assert world == ["counter"]  # only the call that was running when the worker died
    (entry,) = snap.tool_journal
    assert entry.status is ToolCallStatus.INTERRUPTED and entry.result.is_error
    assert "interrupted" in observation_text(tiny_tokenizer, final)
    assert final.num_tool_calls == 1 and final.num_tool_errors == 1
    assert ctx.counters.num_tool_calls_interrupted == 1 and ctx.tools.num_interrupted == 1
    assert snap.messages[-2]["role"] == "tool" and snap.messages[-2]["tool_call_id"] == entry.call_id
    assert snapshots == []  # nothing new was journaled
    assert final.reward == 1.0 + 0.0  # the lost call is not replayed into the restored instance


async def test_idempotent_call_in_doubt_is_rerun_exactly_once(tiny_tokenizer):
    world: list[str] = []
    gate = asyncio.Event()
    tools = (CounterTool(world, gate), IdempotentCounterTool(world, gate, name="icounter"))
    snap = await _die_mid_call(tiny_tokenizer, [COUNT_BOTH, ANSWER], *tools)
    fresh = (CounterTool(world), IdempotentCounterTool(world, name="icounter"))
    ctx, _ = counter_ctx(tiny_tokenizer, [COUNT_BOTH, ANSWER], *fresh)  # another process
    final = await ToolAgentLoop(ctx).run(snap)
    final.validate()
    assert sorted(world) == ["counter", "icounter", "icounter"]
    lost, rerun = snap.tool_journal
    assert lost.status is ToolCallStatus.INTERRUPTED and lost.result.is_error
    assert rerun.status is ToolCallStatus.DONE and rerun.result.text == "count=1"
    assert [m["content"] for m in snap.messages if m["role"] == "tool"] == [lost.result.text, "count=1"]
    assert final.num_tool_calls == 2 and final.num_tool_errors == 1
    assert final.reward == 1.0 + 0.0 + 1.0  # math answer + counter (lost) + icounter (re-run)


async def test_a_turn_of_idempotent_calls_takes_no_snapshot(tiny_tokenizer):
    ctx, snapshots = counter_ctx(tiny_tokenizer, [COUNT, ANSWER], IdempotentCounterTool([], name="counter"))
    final = await ToolAgentLoop(ctx).run(new_data())
    assert final.status is TrajectoryStatus.FINISHED and final.num_tool_calls == 1
    assert snapshots == []  # redoing such a turn from the last durable row is harmless


async def test_a_failed_snapshot_fails_the_trajectory_before_the_tool_runs(tiny_tokenizer):
    world: list[str] = []
    ctx, _ = counter_ctx(tiny_tokenizer, [COUNT, ANSWER], CounterTool(world))

    async def broken(data: AgentData) -> None:
        raise TimeoutError("buffer append not durable within 30 s")

    ctx.snapshot = broken
    with pytest.raises(TimeoutError):
        await ToolAgentLoop(ctx).run(new_data())
    assert world == [] and ctx.tools.num_sessions == 0


async def test_resume_after_the_result_never_reruns_and_restores_the_state(tiny_tokenizer):
    turns = [COUNT, COUNT, ANSWER]
    world: list[str] = []
    gate = asyncio.Event()
    ctx, _ = counter_ctx(tiny_tokenizer, turns, CounterTool(world, gate))
    task = asyncio.create_task(ToolAgentLoop(ctx).run(new_data()))
    await wait_until(lambda: len(world) == 1)
    ctx.cancel.set()
    gate.set()
    parked = AgentData.from_json((await task).agent_data_json)
    assert parked.tool_journal[0].status is ToolCallStatus.DONE

    ctx2, _ = counter_ctx(tiny_tokenizer, turns, CounterTool(world))  # another process
    final = await ToolAgentLoop(ctx2).run(parked)
    final.validate()
    assert world == ["counter", "counter"]  # the first call was not run again
    assert [e.result.text for e in parked.tool_journal] == ["count=1", "count=2"]  # restored count
    assert final.reward == 1.0 + 2.0


async def test_recorded_result_in_a_mid_tool_snapshot_is_used_not_rerun(tiny_tokenizer):
    world: list[str] = []
    snap = await _die_mid_call(tiny_tokenizer, [COUNT, ANSWER], CounterTool(world, asyncio.Event()))
    entry = snap.tool_journal[0]
    entry.status = ToolCallStatus.DONE
    entry.result = ToolResult(call_id=entry.call_id, name=entry.name, text="count=7")
    snap.tool_results.append(entry.result)
    snap = AgentData.from_json(snap.to_json())
    ctx, _ = counter_ctx(tiny_tokenizer, [COUNT, ANSWER], CounterTool(world))
    final = await ToolAgentLoop(ctx).run(snap)
    assert world == ["counter"]  # a recorded call is neither re-run nor reported as interrupted
    assert "count=7" in observation_text(tiny_tokenizer, final)
    assert final.num_tool_calls == 1 and final.num_tool_errors == 0


async def test_failed_trajectory_finalizes_its_interaction_and_releases_its_tools(tiny_tokenizer):
    from streamrl.rollout.interactions import load_interaction_config

    inner, _ = turn_script(tiny_tokenizer, [COUNT, ANSWER])
    num_requests = []

    def script(prompt_ids):  # the first turn works, the second one hits a broken engine
        num_requests.append(1)
        if len(num_requests) > 1:
            raise RuntimeError("engine exploded")
        return inner(prompt_ids)

    world: list[str] = []
    tool = CounterTool(world)
    ctx, _ = counter_ctx(tiny_tokenizer, [COUNT, ANSWER], tool)
    ctx.server = make_ctx(tiny_tokenizer, FakeEngine(script=script)).server
    ctx.interactions = load_interaction_config("configs/interactions/math_feedback.yaml")
    interaction = ctx.interactions["math_feedback"]
    data = new_data()
    data.interaction_name = "math_feedback"
    with pytest.raises(RuntimeError, match="engine exploded"):
        await ToolAgentLoop(ctx).run(data)
    assert world == ["counter"] and data.state is AgentState.GENERATING  # failed in turn 2
    assert data.interaction_instance_id is not None
    with pytest.raises(ValueError, match="no instance"):
        interaction.instance_state(data.interaction_instance_id)  # finalized
    assert ctx.tools.num_sessions == 0 and tool.num_instances == 0


def test_agent_data_with_a_journal_round_trips_through_json():
    data = new_data()
    data.state = AgentState.PROCESSING_TOOLS
    result = ToolResult(call_id="t1_call_0", name="counter", text="count=1", reward=0.5, latency_s=0.25)
    data.tool_journal = [
        ToolJournalEntry(call_id="t1_call_0", name="counter", status=ToolCallStatus.DONE, result=result),
        ToolJournalEntry(call_id="t1_call_1", name="calculator", arguments={"expression": "1 + 1"}),
        ToolJournalEntry(
            call_id="t1_call_2",
            name="counter",
            status=ToolCallStatus.INTERRUPTED,
            result=ToolResult(call_id="t1_call_2", name="counter", text="Error: interrupted", is_error=True),
        ),
    ]
    data.tool_results = [result]
    again = AgentData.from_json(data.to_json())
    assert again == data and again.to_json() == data.to_json()
    assert again.tool_journal[1].status is ToolCallStatus.INTENT and again.tool_journal[1].result is None
    assert again.tool_journal[1].call().arguments == {"expression": "1 + 1"}
