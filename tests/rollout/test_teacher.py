"""The rollout worker's distillation teacher (`rollout.teacher`) with fake engines: one scoring request
per finished trajectory over its whole sequence, however many segments generated it; partial rows
are not scored; a failing teacher engine leaves routing and a dead teacher fails the trajectory."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines.fake import FakeEngine, fake_logprob
from streamrl.rollout.server_manager import ServerManager
from streamrl.rollout.teacher import TeacherScorer
from streamrl.rollout.types import TrajectoryStatus
from streamrl.rollout.worker import RolloutWorker
from tests.rollout.test_agent_loop import ANSWER, CALL, make_ctx, new_data, turn_script


async def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def _worker(tokenizer, teachers: list[FakeEngine]) -> tuple[RolloutWorker, list]:
    script, _ = turn_script(tokenizer, [CALL, ANSWER])
    ctx = make_ctx(tokenizer, FakeEngine(script=script, token_delay_s=0.005))
    rows: list = []

    async def sink(traj):
        rows.append(traj)

    return RolloutWorker(ctx, sink, teacher=TeacherScorer(ServerManager(teachers))), rows


async def test_an_interrupted_trajectory_is_scored_over_all_its_tokens_in_one_request(tiny_tokenizer):
    """Parked mid-generation (a sync) and resumed under a new version: the finished row's teacher
    log-probs cover the tokens of both segments. The fake teacher scores a token as the fake student
    sampled it (`fake_logprob` of its absolute position), so a teacher scoring from the wrong start
    fails the equality."""
    teacher = FakeEngine("teacher-0")
    worker, rows = _worker(tiny_tokenizer, [teacher])
    worker.submit(new_data())
    await _until(lambda: worker.ctx.num_in_engine > 0)
    await asyncio.sleep(0.05)  # a few tokens streamed
    await worker.pause(timeout_s=10.0)
    await worker.ctx.server.set_policy_version(1)  # the sync's new weights label the second segment
    await worker.resume()
    await worker.wait_idle(10.0)
    partial, finished = rows[0], rows[-1]
    assert partial.status is TrajectoryStatus.PARTIAL and partial.teacher_logprobs is None
    assert finished.status is TrajectoryStatus.FINISHED and finished.num_interrupts >= 1
    assert {v for v in finished.policy_versions if v >= 0} == {0, 1}
    (request_id, token_ids, start), *more = teacher.scored
    assert not more and request_id == f"{finished.trajectory_id}-teacher-0"
    assert token_ids == finished.prompt_ids + finished.response_ids and start == len(finished.prompt_ids)
    assert finished.teacher_logprobs == finished.behavior_logprobs  # every sampled token, 0 at observations
    assert any(m == 0 for m in finished.response_mask)  # the tool's observation tokens were there to skip
    assert worker.metrics()["distill/num_scored"] == 1.0
    assert worker.metrics()["distill/num_scored_tokens"] == float(finished.num_sampled_tokens)


async def test_a_shifted_teacher_breaks_the_equality(tiny_tokenizer):
    """The check above can fail: a teacher whose scores are one position off."""
    teacher = FakeEngine("teacher-0")
    teacher.score_logprob = lambda position, token_id: fake_logprob(position - 1, token_id)
    worker, rows = _worker(tiny_tokenizer, [teacher])
    worker.submit(new_data())
    await worker.wait_idle(10.0)
    (row,) = rows
    assert row.teacher_logprobs is not None and row.teacher_logprobs != row.behavior_logprobs


async def test_a_failing_teacher_engine_leaves_routing_and_a_dead_teacher_fails_the_trajectory(tiny_tokenizer):
    broken, healthy = FakeEngine("teacher-0"), FakeEngine("teacher-1")
    broken.fail_with = RuntimeError("teacher engine died")
    worker, rows = _worker(tiny_tokenizer, [broken, healthy])
    worker.submit(new_data())
    await worker.wait_idle(10.0)
    assert rows[-1].status is TrajectoryStatus.FINISHED and rows[-1].teacher_logprobs is not None
    assert worker.teacher is not None and worker.teacher.server.healthy_engine_ids == ["teacher-1"]
    healthy.fail_with = RuntimeError("teacher engine died too")
    worker.submit(new_data("g0/1"))
    await worker.wait_idle(10.0)
    assert rows[-1].status is TrajectoryStatus.FAILED and worker.num_failed == 1


def test_a_scoring_request_is_checked_like_a_generation():
    engine = FakeEngine("teacher-0")
    with pytest.raises(ValueError, match="score start"):
        asyncio.run(engine.score("r", [1, 2, 3], 0))  # no logits predict the first token
    assert asyncio.run(engine.score("r", [1, 2, 3], 3)) == []
