"""Durable generation progress (`rollout.agent.progress_every_s`): a running trajectory's tokens
become a durable partial row at a bounded interval, a long generation is cut there and its turn goes
on, and a trajectory resumed from its newest such row finishes as if nothing had happened.

On the scripted engine of `test_agent_loop` (it continues whatever assistant turn the prompt ends in)
with the tiny tokenizer and the real tools; the snapshot hook stands in for the worker's durable
append and keeps the rows it was given."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.agent_loop import ToolAgentLoop
from streamrl.rollout.types import AgentData, AgentState, FinishReason, TrajectoryStatus
from tests.rollout.test_agent_loop import ANSWER, CALL, SLOW_CALL, make_ctx, new_data, turn_script

pytestmark = pytest.mark.timeout(60)
LONG = "Let me think about this carefully before I call the calculator tool. " * 2 + CALL


def durable_rows(ctx) -> list[AgentData]:
    """Install a snapshot hook that keeps each durable row, as its JSON would come back on a resume."""
    rows: list[AgentData] = []

    async def snapshot(data: AgentData) -> None:
        rows.append(AgentData.from_json(data.to_json()))

    ctx.snapshot = snapshot
    return rows


def tool_observation(ctx) -> list[int]:
    return ctx.encoder.encode_new_messages([{"role": "tool", "content": "84"}])


async def test_a_long_generation_is_cut_made_durable_and_its_turn_goes_on(tiny_tokenizer):
    """Each cut leaves a durable row holding exactly the tokens streamed so far (a prefix of the
    final trajectory, with their versions); the finished trajectory is the one an uncut run gives."""
    script, turn_ids = turn_script(tiny_tokenizer, [LONG, ANSWER])
    engine = FakeEngine(script=script, token_delay_s=0.01, policy_version=2)
    ctx = make_ctx(tiny_tokenizer, engine, progress_every_s=0.15)
    rows = durable_rows(ctx)
    final = await ToolAgentLoop(ctx).run(new_data())

    final.validate()
    assert final.status is TrajectoryStatus.FINISHED and final.reward == 1.0
    assert final.response_ids == turn_ids[0] + tool_observation(ctx) + turn_ids[1]
    assert len(turn_ids[0]) * 0.01 > 3 * 0.15  # the first turn takes several intervals to sample
    assert ctx.counters.num_progress_cuts >= 3 and ctx.counters.num_progress_rows == len(rows)
    sizes = [len(r.response_ids) for r in rows]
    assert sizes == sorted(set(sizes)) and 0 < sizes[0]  # every row holds more than the one before
    for row in rows:
        n = len(row.response_ids)
        assert row.response_ids == final.response_ids[:n]
        assert row.policy_versions == final.policy_versions[:n] and row.behavior_logprobs == final.behavior_logprobs[:n]
        assert row.state is AgentState.GENERATING
    # two turns, one more request per cut, each re-sending the trajectory as far as the row before it
    assert len(engine.requests_seen) == 2 + ctx.counters.num_progress_cuts
    sent = [prompt for _, prompt in engine.requests_seen]
    assert all(final.prompt_ids + row.response_ids in sent for row in rows)


async def test_a_trajectory_resumed_from_its_newest_row_loses_at_most_one_interval(tiny_tokenizer):
    """A crash while the first turn is being sampled: the resumed trajectory (from the newest durable
    row, in a fresh context) is token for token the trajectory of an uncrashed run, and what the crash
    lost is what was sampled after that row, at most one interval of generation."""
    script, turn_ids = turn_script(tiny_tokenizer, [LONG, ANSWER])
    delay, every = 0.01, 0.15
    engine = FakeEngine(script=script, token_delay_s=delay)
    ctx = make_ctx(tiny_tokenizer, engine, progress_every_s=every)
    rows = durable_rows(ctx)
    data = new_data()
    task = asyncio.create_task(ToolAgentLoop(ctx).run(data))
    while len(rows) < 2:
        await asyncio.sleep(0.005)
    await asyncio.sleep(every / 2)
    streamed = engine.stats().num_running and len(data.response_ids)  # what the loop holds before the crash
    task.cancel()  # the worker dies here
    with pytest.raises(asyncio.CancelledError):
        await task
    newest = rows[-1]
    assert 0 < len(newest.response_ids) < len(turn_ids[0]) and streamed >= len(newest.response_ids)

    ctx2 = make_ctx(tiny_tokenizer, engine)  # another worker, progress rows off
    final = await ToolAgentLoop(ctx2).run(AgentData.from_json(newest.to_json()))
    final.validate()
    assert final.status is TrajectoryStatus.FINISHED and final.finish_reason is FinishReason.STOP
    assert final.response_ids == turn_ids[0] + tool_observation(ctx2) + turn_ids[1]


async def test_a_row_is_made_before_the_next_turn_once_the_interval_passed_in_a_tool(tiny_tokenizer):
    """A slow tool: the trajectory grew by a tool observation and the interval passed, so a row is
    written before the next turn is sent, holding the observation and no token of the new turn."""
    script, turn_ids = turn_script(tiny_tokenizer, [SLOW_CALL, ANSWER])
    engine = FakeEngine(script=script)
    ctx = make_ctx(tiny_tokenizer, engine, tool_yaml="configs/tools/sleep.yaml", progress_every_s=0.2)
    rows = durable_rows(ctx)
    final = await ToolAgentLoop(ctx).run(new_data())
    final.validate()
    assert final.status is TrajectoryStatus.FINISHED
    assert ctx.counters.num_progress_cuts == 0 and ctx.counters.num_progress_rows == 1 and len(rows) == 1
    (row,) = rows
    assert row.state is AgentState.GENERATING and row.response_mask[-1] == 0 and len(row.tool_results) == 1
    assert final.response_ids[: len(row.response_ids)] == row.response_ids
    assert row.turn_start == len(row.response_ids)


async def test_without_the_setting_no_progress_row_is_written(tiny_tokenizer):
    script, _ = turn_script(tiny_tokenizer, [LONG, ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script, token_delay_s=0.005))
    rows = durable_rows(ctx)
    final = await ToolAgentLoop(ctx).run(new_data())
    assert final.status is TrajectoryStatus.FINISHED
    assert rows == [] and ctx.counters.num_progress_rows == 0 and ctx.counters.num_progress_cuts == 0


async def test_a_pause_still_parks_a_generation_that_progress_rows_would_cut_later(tiny_tokenizer):
    """The weight-sync interrupt wins over the progress timer: the generation parks (a PARTIAL
    trajectory returned to the worker), it is not cut and continued."""
    script, turn_ids = turn_script(tiny_tokenizer, [LONG, ANSWER])
    engine = FakeEngine(script=script, token_delay_s=0.01)
    ctx = make_ctx(tiny_tokenizer, engine, progress_every_s=30.0)
    rows = durable_rows(ctx)
    data = new_data()
    task = asyncio.create_task(ToolAgentLoop(ctx).run(data))
    started = time.monotonic()
    while engine.stats().num_running == 0 and time.monotonic() - started < 10:
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.05)
    ctx.cancel.set()
    parked = await task
    assert parked.status is TrajectoryStatus.PARTIAL and parked.finish_reason is FinishReason.ABORT
    assert 0 < len(parked.response_ids) < len(turn_ids[0]) and rows == []
    assert ctx.counters.num_progress_cuts == 0


def test_a_seeded_sampler_is_refused_with_progress_cuts():
    from streamrl.rollout.config import AgentConfig

    with pytest.raises(ValueError, match="unset one of the two"):
        AgentConfig(progress_every_s=10.0, sampling={"seed": 7})
    assert AgentConfig(progress_every_s=10.0).progress_every_s == 10.0
    assert AgentConfig(sampling={"seed": 7}).sampling.seed == 7
