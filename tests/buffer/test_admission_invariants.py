"""Admission and sampling keep the staleness contract when groups finish out of order (I3).

Each scenario is one the first implementation got wrong: a finished member of an open group was
not counted, `reuse` grew capacity a full batch per version, and a long group that finished after
shorter, younger ones was evicted (length bias).
"""

from __future__ import annotations

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import TrajectoryStatus
from tests.buffer.helpers import make_group, make_traj

PARTIAL = TrajectoryStatus.PARTIAL


def _buf(**kw) -> ReplayBuffer:
    kw.setdefault("batch_size", 4)
    kw.setdefault("group_size", 4)
    return ReplayBuffer(BufferConfig(**kw))


def _admit(buf: ReplayBuffer, gid: str, version: int, n: int) -> None:
    """What the driver does at admission: PENDING (partial) rows for the whole group."""
    buf.append([make_traj(gid, i, status=PARTIAL, version=version, num_response=0) for i in range(n)])


def test_finished_members_of_open_groups_count_as_in_flight():
    """max_staleness=0, batch 16, groups of 8: after 7/8 finish in two groups nothing may start."""
    buf = _buf(batch_size=16, group_size=8, max_staleness=0)
    assert buf.capacity(served_step=0) == 16
    for gid in ("a", "b"):
        _admit(buf, gid, 0, 8)
        buf.append([make_traj(gid, i, version=0) for i in range(7)])  # 7 of 8 finished, 1 still running
    assert buf.capacity(served_step=0) == 0


def test_capacity_counts_fresh_trajectories_per_step_under_reuse():
    """reuse=2: each step consumes batch/2 fresh trajectories, so capacity grows batch/2 per version."""
    buf = _buf(batch_size=4, group_size=2, max_staleness=0, reuse=2)
    assert buf.capacity(served_step=0) == 2
    assert buf.capacity(served_step=1) == 4
    buf.append(make_group("a", 2))
    assert buf.capacity(served_step=1) == 2


def test_long_group_that_finishes_late_is_trained_not_evicted():
    """max_staleness=1, batch = group = 4: A and B start at v0; short B, C, D are trained at v0..v2;
    long A finishes at v3 with lag 3. By default it is trained (oldest first), not dropped."""
    buf = _buf(max_staleness=1)
    _admit(buf, "A", 0, 4)
    _admit(buf, "B", 0, 4)
    buf.append(make_group("B", 4, version=0))
    assert buf.sample(served_version=0, learner_step=1).trajectory_ids[0] == "B/0"
    for step, gid in ((1, "C"), (2, "D")):
        _admit(buf, gid, step, 4)
        buf.append(make_group(gid, 4, version=step))
        assert buf.sample(served_version=step, learner_step=step + 1).trajectory_ids[0] == f"{gid}/0"
    buf.append(make_group("A", 4, version=0, num_response=40))  # the long one
    _admit(buf, "E", 3, 4)
    buf.append(make_group("E", 4, version=3))
    batch = buf.sample(served_version=3, learner_step=4)
    assert batch.trajectory_ids == ["A/0", "A/1", "A/2", "A/3"]  # oldest-started first, not E
    assert batch.lags.tolist() == [3, 3, 3, 3]
    stats = buf.stats()
    assert stats["buffer/over_age_trained"] == 4 and stats["buffer/evicted_over_age"] == 0
    assert stats["staleness/length_bias"] > 1.0  # A (long) was trained: no bias towards short ones


def test_dropping_over_age_is_explicit_and_counted_by_length():
    buf = _buf(max_staleness=1, over_age="evict")
    _admit(buf, "A", 0, 4)
    buf.append(make_group("A", 4, version=0, num_response=40))
    buf.append(make_group("B", 4, version=3))
    assert buf.sample(served_version=3, learner_step=1).trajectory_ids[0] == "B/0"
    stats = buf.stats()
    assert stats["buffer/evicted_over_age"] == 4
    assert stats["length/dropped_over_age_le_64"] == 4  # 3 prompt + 40 response tokens
    assert stats["staleness/length_bias"] < 1.0  # trained only the short group
