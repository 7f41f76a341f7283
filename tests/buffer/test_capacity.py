"""`buffer.capacity_rows`: a row that replaces a row never waits for room (a full buffer of in-flight
work would otherwise deadlock), admission keeps within the capacity, and a capacity that cannot hold
a batch plus a group in flight is refused up front."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.schema import trajectories_to_batch
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import TrajectoryStatus
from streamrl.streaming.actors.buffer import BufferActor
from tests.buffer.helpers import make_traj

P = TrajectoryStatus.PARTIAL


def test_finished_rows_replacing_partial_rows_are_accepted_by_a_full_buffer():
    async def run() -> list[list[str]]:
        actor = BufferActor(BufferConfig(batch_size=2, group_size=2, capacity_rows=4))
        try:
            for g in "abc":  # admitted before the buffer filled: 6 partial rows, over the capacity
                assert await actor.append([make_traj(g, i, status=P) for i in range(2)])
            assert actor.buffer.stats()["buffer/live_rows"] == 6 and actor.buffer.capacity(served_step=0) == 0
            batches = []
            for g in "abc":
                for i in range(2):
                    assert await actor.append([make_traj(g, i)], timeout_s=0.2), f"{g}/{i} refused"
                batches.append((await actor.sample(0, len(batches) + 1)).trajectory_ids)
            assert actor.num_backpressure_timeouts == 0
            return batches
        finally:
            await actor.close()

    assert asyncio.run(run()) == [["a/0", "a/1"], ["b/0", "b/1"], ["c/0", "c/1"]]


def test_new_rows_still_wait_for_room():
    buf = ReplayBuffer(BufferConfig(batch_size=2, group_size=2, capacity_rows=4))
    buf.append([make_traj(g, i, status=P) for g in "ab" for i in range(2)])
    replacing = trajectories_to_batch([make_traj("a", 0), make_traj("a", 0)])
    assert buf.num_new_rows(replacing) == 0 and buf.has_room(0)
    fresh = trajectories_to_batch([make_traj("c", 0), make_traj("a", 1)])
    assert buf.num_new_rows(fresh) == 1 and not buf.has_room(1)


def test_admission_keeps_within_capacity_rows():
    buf = ReplayBuffer(BufferConfig(batch_size=4, group_size=2, capacity_rows=7, max_staleness=4))
    assert buf.capacity(served_step=0) == 6  # the staleness formula alone would allow 20
    buf.append([make_traj("a", i, status=P) for i in range(2)])
    assert buf.capacity(served_step=0) == 4
    buf.append([make_traj(g, i, status=P) for g in "bc" for i in range(2)])
    assert buf.capacity(served_step=0) == 0  # 6 live rows: one row of room is not a group


@pytest.mark.parametrize("kw", [{"capacity_rows": 5}, {"capacity_rows": 2, "max_batch_tokens": 100}])
def test_a_capacity_below_one_batch_plus_one_group_is_refused(kw):
    with pytest.raises(ValueError, match=r"buffer\.capacity_rows .* buffer\.batch_size \+ buffer\.group_size"):
        BufferConfig(batch_size=4, group_size=2, **kw)
    with pytest.raises(ValueError, match=r'buffer\.capacity_rows cannot be combined with buffer\.over_age = "keep"'):
        BufferConfig(batch_size=4, group_size=2, capacity_rows=6, over_age="keep")
    BufferConfig(batch_size=4, group_size=2, capacity_rows=6)
