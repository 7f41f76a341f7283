"""Scoring at trajectory end (`rollout/agent_loop/scoring.py`): a non-finite reward from the reward fn,
a tool or an interaction fails the trajectory with a reason, and a hanging reward fn fails it after
`reward_timeout_s` while the worker's event loop keeps serving the other trajectories."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.types import FinishReason, TrajectoryStatus
from streamrl.rollout.worker import RolloutWorker
from tests.rollout.test_agent_loop import ANSWER, CALL, make_ctx, new_data, turn_script


async def _run_in_worker(ctx, data=None):
    """One trajectory through a `RolloutWorker` (its fault boundary): (the row, the worker)."""
    rows: list = []

    async def sink(traj):
        rows.append(traj)

    worker = RolloutWorker(ctx, sink)
    worker.submit(data or new_data())
    await worker.wait_idle(20)
    assert len(rows) == 1
    return rows[0], worker


def _assert_failed(row, worker, reason: str) -> None:
    assert row.status is TrajectoryStatus.FAILED and row.finish_reason is FinishReason.ERROR
    assert worker.num_failed == 1 and reason in worker.errors[0], worker.errors


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
async def test_a_non_finite_reward_fn_result_fails_the_trajectory(tiny_tokenizer, value):
    script, _ = turn_script(tiny_tokenizer, [ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    ctx.reward_fn = lambda inp: value
    row, worker = await _run_in_worker(ctx)
    _assert_failed(row, worker, f"reward function <lambda> is {value}")


@pytest.mark.parametrize("value", [1e39, -1e39, 3e38, 2e15])
async def test_a_reward_that_overflows_float32_group_statistics_fails_the_trajectory(tiny_tokenizer, value):
    """1e39 is finite in float64 but inf in the learner's float32 batch (a lost step); 3e38 and 2e15 are
    finite there, but a group's sum or squared deviations of them are not."""
    script, _ = turn_script(tiny_tokenizer, [ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    ctx.reward_fn = lambda inp: value
    row, worker = await _run_in_worker(ctx)
    _assert_failed(row, worker, f"reward function <lambda> is {value}: not finite in the learner's float32")


async def test_a_total_of_in_range_parts_beyond_the_range_fails_the_trajectory(tiny_tokenizer, monkeypatch):
    script, _ = turn_script(tiny_tokenizer, [CALL, ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    ctx.reward_fn = lambda inp: 9e14

    async def big_rewards(instance_ids):
        return {"calculator": 9e14}

    monkeypatch.setattr(ctx.tools, "tool_rewards", big_rewards)
    row, worker = await _run_in_worker(ctx)
    _assert_failed(row, worker, "the total reward is 1800000000000000.0")


async def test_a_numpy_nan_from_a_verl_compute_score_fails_the_trajectory(tiny_tokenizer):
    import numpy as np

    from streamrl.rollout.rewards import verl_reward_fn

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return np.float64("nan")

    script, _ = turn_script(tiny_tokenizer, [ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    ctx.reward_fn = verl_reward_fn(compute_score)
    row, worker = await _run_in_worker(ctx)
    _assert_failed(row, worker, "finite")


async def test_a_non_finite_tool_reward_fails_the_trajectory(tiny_tokenizer, monkeypatch):
    script, _ = turn_script(tiny_tokenizer, [CALL, ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))

    async def nan_rewards(instance_ids):
        return {"calculator": float("nan")}

    monkeypatch.setattr(ctx.tools, "tool_rewards", nan_rewards)
    row, worker = await _run_in_worker(ctx)
    _assert_failed(row, worker, "a tool reward is nan")


@pytest.mark.parametrize("where", ["turn", "final"])
async def test_a_non_finite_interaction_score_fails_the_trajectory(tiny_tokenizer, monkeypatch, where):
    from streamrl.rollout.interactions import load_interaction_config

    script, _ = turn_script(tiny_tokenizer, ["I think it is \\boxed{80}.", ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    ctx.tools = None
    ctx.interactions = load_interaction_config("configs/interactions/math_feedback.yaml")
    interaction = ctx.interactions["math_feedback"]
    if where == "turn":
        real = interaction.generate_response

        async def nan_turn(*args, **kwargs):
            stop, reply, _score, extra = await real(*args, **kwargs)
            return stop, reply, float("inf"), extra

        monkeypatch.setattr(interaction, "generate_response", nan_turn)
    else:

        async def nan_score(instance_id):
            return float("nan")

        monkeypatch.setattr(interaction, "calculate_score", nan_score)
    data = new_data()
    data.interaction_name = "math_feedback"
    row, worker = await _run_in_worker(ctx, data)
    _assert_failed(row, worker, f"{'turn score' if where == 'turn' else 'score'} of interaction math_feedback is")


@pytest.mark.timeout(60)
async def test_a_hanging_reward_fn_fails_after_the_timeout_and_the_loop_stays_responsive(tiny_tokenizer):
    script, _ = turn_script(tiny_tokenizer, [ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script), reward_timeout_s=0.5)
    entered, release = threading.Event(), threading.Event()

    def hanging(inp):  # blocks its thread, as a runaway regex or a stuck call would
        entered.set()
        release.wait(30)
        return 1.0

    ctx.reward_fn = hanging
    ticks: list[float] = []

    async def heartbeat():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    beat = asyncio.create_task(heartbeat())
    try:
        t0 = time.monotonic()
        row, worker = await _run_in_worker(ctx)
        elapsed = time.monotonic() - t0
    finally:
        beat.cancel()
        release.set()
    assert entered.is_set()
    _assert_failed(row, worker, "did not return within 0.5 s (rollout.agent.reward_timeout_s)")
    assert 0.5 <= elapsed < 15
    during = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) >= 20 and max(during) < 0.4  # the event loop never stalled while the reward fn hung
