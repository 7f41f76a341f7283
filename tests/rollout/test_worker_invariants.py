"""RolloutWorker keeps every trajectory owned by exactly one place (I2) and never loses a row.

Scenarios the first implementation got wrong: a resume that arrives while a parking loop is still
saving its partial row dropped the trajectory for good; a sink refusing a row (backpressure) or
raising was ignored while the trajectory was counted as finished.
"""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.types import TrajectoryStatus
from streamrl.rollout.worker import RolloutWorker
from tests.rollout.test_agent_loop import ANSWER, CALL, make_ctx, new_data, turn_script


async def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def _parking_worker(tokenizer) -> tuple[RolloutWorker, asyncio.Event, list]:
    """A worker generating a tool-call turn (the trajectory is in the engine when this returns) whose
    sink holds every partial (parked) row until the event is set: the buffer append of a parked row
    takes a while. Returns (worker, that event, the rows saved so far)."""
    script, _ = turn_script(tokenizer, [CALL, ANSWER])
    ctx = make_ctx(tokenizer, FakeEngine(script=script, token_delay_s=0.01))
    release = asyncio.Event()
    rows = []

    async def slow_sink(traj):
        if traj.status is TrajectoryStatus.PARTIAL:
            await release.wait()
        rows.append(traj)

    worker = RolloutWorker(ctx, slow_sink)
    worker.submit(new_data())
    await _until(lambda: ctx.num_in_engine > 0)
    return worker, release, rows


async def test_resume_while_a_parked_row_is_being_saved_keeps_the_trajectory(tiny_tokenizer):
    worker, release, rows = await _parking_worker(tiny_tokenizer)
    with pytest.raises(TimeoutError):
        await worker.pause(timeout_s=0.2)  # the sync fails fast: the parked row is still being saved
    await worker.resume()  # ... and generation resumes before the row is saved
    release.set()
    await _until(lambda: any(t.status is TrajectoryStatus.FINISHED for t in rows))
    await worker.wait_idle(10)
    assert [t.status for t in rows] == [TrajectoryStatus.PARTIAL, TrajectoryStatus.FINISHED]
    assert worker.running_ids() == [] and worker.num_finished == 1 and worker.num_resumed == 1


async def test_rows_refused_under_backpressure_are_retried_before_counting(tiny_tokenizer):
    script, _ = turn_script(tiny_tokenizer, [ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    answers = iter([False, False, True])
    calls = []

    async def full_buffer(traj):
        calls.append(traj.trajectory_id)
        accepted = next(answers)
        if not accepted:
            assert worker.num_finished == 0  # not counted before the row is saved
        return accepted

    worker = RolloutWorker(ctx, full_buffer, sink_retry_s=0.01)
    worker.submit(new_data())
    await _until(lambda: worker.num_finished == 1)
    assert calls == ["g0/0"] * 3 and worker.num_sink_retries == 2
    assert worker.running_ids() == []


async def test_a_sink_that_keeps_failing_is_a_worker_fault(tiny_tokenizer):
    script, _ = turn_script(tiny_tokenizer, [ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    attempts = []

    async def broken(traj):
        attempts.append(traj.trajectory_id)
        raise ConnectionError("buffer unreachable")

    worker = RolloutWorker(ctx, broken, sink_retry_s=0.001)
    worker.submit(new_data())
    await _until(lambda: not worker.running_ids())
    assert len(attempts) == 5 and worker.num_finished == 0
    with pytest.raises(RuntimeError, match="could not be saved"):
        worker.check()


def _one_turn_worker(tokenizer) -> tuple[RolloutWorker, list]:
    """A worker whose trajectories answer in one turn, saving rows into the returned list."""
    script, _ = turn_script(tokenizer, [ANSWER])
    rows: list = []

    async def sink(traj):
        rows.append(traj)

    return RolloutWorker(make_ctx(tokenizer, FakeEngine(script=script)), sink), rows


async def test_a_pause_landing_after_its_resume_is_ignored(tiny_tokenizer):
    """Fencing (I2 with I7): the coordinator's pause timed out, it resumed, and then the pause ran
    here. Unfenced, the worker would hold every trajectory until the next sync."""
    worker, rows = _one_turn_worker(tiny_tokenizer)
    await worker.resume(epoch=7)
    await worker.pause(timeout_s=1.0, epoch=7)  # late: ignored
    worker.submit(new_data())
    await _until(lambda: worker.num_finished == 1)
    assert worker.num_held == 0 and [t.status for t in rows] == [TrajectoryStatus.FINISHED]


async def test_a_pause_overtaken_by_its_resume_while_parking_returns(tiny_tokenizer):
    """The resume of the same sync arrives while the pause still waits for a row to be saved: the
    pause stops waiting (no timeout) and the worker serves."""
    worker, release, rows = await _parking_worker(tiny_tokenizer)
    pausing = asyncio.create_task(worker.pause(timeout_s=30.0, epoch=3))
    await _until(lambda: worker._num_sinking > 0)  # parking: the partial row is being saved
    await worker.resume(epoch=3)
    await asyncio.wait_for(pausing, 2.0)  # returns at once, not after 30 s or with a TimeoutError
    release.set()
    await _until(lambda: worker.num_finished == 1)
    assert [t.status for t in rows] == [TrajectoryStatus.PARTIAL, TrajectoryStatus.FINISHED]


async def test_a_stale_resume_does_not_end_a_newer_pause(tiny_tokenizer):
    worker, rows = _one_turn_worker(tiny_tokenizer)
    await worker.pause(timeout_s=1.0, epoch=5)
    await worker.resume(epoch=4)  # the late resume of the previous sync
    worker.submit(new_data())
    await asyncio.sleep(0.2)
    assert worker.num_held == 1 and rows == []  # still paused: held, not generating
    await worker.resume(epoch=5)
    await _until(lambda: worker.num_finished == 1)
