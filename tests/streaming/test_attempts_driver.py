"""The driver's resubmission fences the previous holder out: a trajectory handed to another worker
after its worker died is a new attempt, recorded durably before the new worker gets it, so the dead
worker's late appends (its park, its finish) are refused and the resubmitted attempt is what trains,
exactly once. Same harness as test_driver_loops.py."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import AgentData, FinishReason, Trajectory, TrajectoryStatus
from tests.streaming.test_driver_loops import (
    TIMEOUT_S,
    FakeWorker,
    _check_admission,
    _check_batches,
    _pipeline,
    _run_to_end,
)

STALE_REWARD = 99.0  # what the dead worker's late finish would train if it were accepted


class LateWorker(FakeWorker):
    """Killed, it keeps what it ran, and its appends for it land later (`late_append`): a park
    (partial row, more progress) and a finish, both of the attempt it was given."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.given: dict[str, AgentData] = {}
        self.late: list[Trajectory] = []

    async def submit(self, items: list[AgentData]) -> int:
        for data in items:
            self.given[data.trajectory_id] = data.model_copy(deep=True)
        return await super().submit(items)

    async def late_append(self, trajectory_id: str) -> None:
        data = self.given[trajectory_id]
        data.append_sampled([8, 9], [-0.5, -0.5], [0, 0])
        common = dict(
            trajectory_id=data.trajectory_id,
            group_id=data.group_id,
            sample_index=data.sample_index,
            agent_name=data.agent_name,
            prompt_ids=[1, 2, 3],
            response_ids=list(data.response_ids),
            response_mask=list(data.response_mask),
            behavior_logprobs=list(data.behavior_logprobs),
            policy_versions=list(data.policy_versions),
            attempt=data.attempt,
        )
        rows = [
            Trajectory(
                **common,
                status=TrajectoryStatus.PARTIAL,
                finish_reason=FinishReason.ABORT,
                agent_data_json=data.to_json(),
            ),
            Trajectory(**common, reward=STALE_REWARD),
        ]
        for row in rows:  # two appends, as a worker's sink makes them
            await self.buffer.append([row])
        self.late += rows


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_dead_workers_late_appends_are_refused_and_the_resubmitted_attempt_trains_once(tmp_path, caplog):
    pipeline, buffer, learner = _pipeline(tmp_path)
    victim = LateWorker("worker-0", buffer, pipeline.workers[0].served, seed=0)
    pipeline.workers[0] = victim
    victim.die_on_submit = 2  # while it runs two fresh groups' members

    async def slow_step() -> None:  # a learner step outlasts the health check (not a race with it)
        while victim.dead and not pipeline.num_worker_replacements:
            await asyncio.sleep(0.01)

    learner.on_step = slow_step
    fenced: list[Trajectory] = []
    append_durable = buffer.append_durable

    async def fencing_then_late(rows: list[Trajectory]) -> None:
        """The worst moment for the late appends: right after the driver recorded the new attempt,
        before the new worker got the trajectory."""
        await append_durable(rows)
        for row in rows:
            if row.attempt > 0:
                fenced.append(row)
                if row.trajectory_id in victim.lost:
                    await victim.late_append(row.trajectory_id)

    buffer.append_durable = fencing_then_late
    with caplog.at_level(logging.WARNING, logger="streamrl.buffer.groups"):
        accounting = await _run_to_end(pipeline)
    lost = victim.lost
    assert len(lost) >= 2, "the victim ran nothing when it was killed: the test proves nothing"
    assert pipeline.num_worker_replacements == 1 and pipeline.state.learner_step == 8
    # every trajectory the victim lost was resubmitted as attempt 1, recorded before its new worker got it
    assert sorted(r.trajectory_id for r in fenced) == sorted(lost) and {r.attempt for r in fenced} == {1}
    assert {row.attempt for row in victim.late} == {0} and len(victim.late) == 2 * len(lost)
    stats = buffer.rb.stats()
    assert stats["buffer/stale_attempt_rows"] == len(victim.late)
    assert sum("is older than the current attempt 1" in r.getMessage() for r in caplog.records) == len(victim.late)
    trained = _check_batches(pipeline, buffer)  # whole groups, no trajectory twice
    _check_admission(pipeline, buffer)
    assert accounting["stranded"] == [] and accounting["untracked"] == []
    rows = {}
    for batch in buffer.sampled:
        for tid, attempt, reward in zip(
            batch.trajectory_ids,
            batch.table.column("attempt").to_pylist(),
            batch.table.column("reward").to_pylist(),
        ):
            rows[tid] = (attempt, reward)
    survivors = [w for w in pipeline.created_workers if w is not victim]
    held_now = set().union(*(w.tasks for w in survivors))
    for tid in lost:  # trained once, as the resubmitted attempt; or still running there, at attempt 1
        if tid in trained:
            assert rows[tid][0] == 1 and rows[tid][1] != STALE_REWARD, (tid, rows[tid])
        else:
            assert tid in held_now and tid in accounting["resumable"], tid
            assert [t.attempt for t in buffer.rb.resumable([tid])] == [1]
    assert lost & trained, "no resubmitted trajectory trained: the test proves nothing"


@pytest.mark.timeout(TIMEOUT_S)
async def test_resubmission_on_resume_is_a_new_attempt_recorded_in_the_log(tmp_path):
    """`--resume` resubmits what the log left unfinished through the same path: each trajectory's
    attempt goes up by one, durably, every time (a recovered buffer knows it)."""
    pipeline, buffer, _ = _pipeline(tmp_path, f"buffer.root_dir={tmp_path / 'buffer'}")
    try:
        for w in pipeline.workers:
            w.unpaused.clear()  # what is submitted stays in flight
        assert await pipeline.admit_next_group()
        admitted = sorted(buffer.rb.resumable_ids())
        served = pipeline.workers[0].served
        assert len(admitted) == 2
        for attempt in (1, 2):  # the job is killed and resumed, twice
            for w in pipeline.workers:
                w.kill()
            buffer.rb.checkpoint()
            del buffer.rb
            gc.collect()
            buffer.rb = ReplayBuffer(pipeline.cfg.buffer)  # recovered from the log
            assert {t.attempt for t in buffer.rb.resumable()} == {attempt - 1}
            pipeline.workers = [LateWorker(f"worker-{attempt}-{i}", buffer, served, seed=i) for i in range(2)]
            for w in pipeline.workers:
                w.unpaused.clear()
            assert await pipeline.resubmit_orphans() == 2
            given = {tid: data.attempt for w in pipeline.workers for tid, data in w.given.items()}
            assert given == dict.fromkeys(admitted, attempt)  # the workers resume the new attempt
            assert {t.trajectory_id: t.attempt for t in buffer.rb.resumable()} == dict.fromkeys(admitted, attempt)
            assert {t.agent_data().attempt for t in buffer.rb.resumable()} == {attempt}
    finally:
        for w in pipeline.workers:
            await w.shutdown()
        buffer.rb.close()
        pipeline.metrics.close()


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_resubmission_whose_images_the_log_lost_is_still_fenced_and_resubmitted(tmp_path, caplog):
    """A partial row referencing images whose bytes a torn image segment lost: the buffer refuses the
    next attempt's row with its image columns; it is recorded without them (the worker then fails the
    trajectory, as before attempts existed) instead of stopping the resume."""
    from streamrl.buffer.images import IMAGES_PREFIX
    from tests.buffer.helpers import make_traj
    from tests.buffer.test_images import RED, _with_images

    root = tmp_path / "buffer"
    pipeline, buffer, _ = _pipeline(tmp_path, f"buffer.root_dir={root}")
    try:
        rows = [_with_images(make_traj("img", i, status=TrajectoryStatus.PARTIAL), [RED]) for i in range(2)]
        buffer.rb.append(rows, images=[RED], durable=True)
        buffer.rb.close()
        for path in root.glob(f"{IMAGES_PREFIX}*"):
            path.unlink()  # the image bytes are gone, the rows are not
        buffer.rb = ReplayBuffer(pipeline.cfg.buffer)
        assert sorted(buffer.rb.resumable_ids()) == ["img/0", "img/1"]
        served = pipeline.workers[0].served
        pipeline.workers = [LateWorker("worker-r", buffer, served, seed=0)]
        pipeline.workers[0].unpaused.clear()
        with caplog.at_level(logging.WARNING, logger="streamrl.streaming.pipeline"):
            assert await pipeline.resubmit_orphans() == 2
        assert any("without their image columns" in r.getMessage() for r in caplog.records)
        assert {tid: d.attempt for tid, d in pipeline.workers[0].given.items()} == {"img/0": 1, "img/1": 1}
        assert {t.attempt for t in buffer.rb.resumable()} == {1}
    finally:
        for w in pipeline.workers:
            await w.shutdown()
        buffer.rb.close()
        pipeline.metrics.close()
