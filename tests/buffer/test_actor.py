"""BufferActor on a real local Ray cluster: appends via object refs, sampling, backpressure."""

from __future__ import annotations

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.schema import trajectories_to_batch
from streamrl.rollout.types import TrajectoryStatus
from streamrl.streaming.actors.buffer import create_buffer_actor
from tests.buffer.helpers import make_group, make_traj
from tests.fixtures.ray_cluster import RAY_TIMEOUT_S

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


def test_append_by_ref_sample_and_recover(ray_cluster, tmp_path):
    ray = ray_cluster
    cfg = BufferConfig(root_dir=str(tmp_path), batch_size=4, group_size=2, flush_every_ms=50)
    actor = create_buffer_actor(cfg)
    refs = [ray.put(trajectories_to_batch(make_group(g, 2))) for g in "ab"]
    assert ray.get([actor.append.remote(r) for r in refs], timeout=RAY_TIMEOUT_S) == [True, True]
    assert ray.get(actor.num_ready.remote(), timeout=RAY_TIMEOUT_S) == 4
    batch = ray.get(actor.sample.remote(0, 1), timeout=RAY_TIMEOUT_S)
    assert sorted(batch.trajectory_ids) == ["a/0", "a/1", "b/0", "b/1"]  # two concurrent appends
    assert ray.get(actor.sample.remote(0, 2), timeout=RAY_TIMEOUT_S) is None
    ray.get(
        actor.append.remote(ray.put(trajectories_to_batch([make_traj("c", 0, status=TrajectoryStatus.PARTIAL)]))),
        timeout=RAY_TIMEOUT_S,
    )
    ray.get(actor.append.remote(make_group("d", 2)), timeout=RAY_TIMEOUT_S)  # a plain list works too
    assert ray.get(actor.sample.remote(0, 2), timeout=RAY_TIMEOUT_S) is None  # one complete group (d); c is partial
    stats = ray.get(actor.stats.remote(), timeout=RAY_TIMEOUT_S)
    assert stats["buffer/trajectories_consumed"] == 4 and stats["buffer/partial_trajectories"] == 1
    ray.get(actor.close.remote(), timeout=RAY_TIMEOUT_S)
    ray.kill(actor)

    actor = create_buffer_actor(cfg)
    resumable = ray.get(actor.resumable.remote(), timeout=RAY_TIMEOUT_S)
    assert [t.trajectory_id for t in resumable] == ["c/0"]
    assert ray.get(actor.num_ready.remote(), timeout=RAY_TIMEOUT_S) == 2
    ray.get(actor.close.remote(), timeout=RAY_TIMEOUT_S)
    ray.kill(actor)


def test_backpressure_waits_for_room(ray_cluster):
    ray = ray_cluster
    actor = create_buffer_actor(BufferConfig(batch_size=2, group_size=2, capacity_rows=4))
    assert ray.get(
        actor.append.remote(ray.put(trajectories_to_batch(make_group("a", 2) + [make_traj("z", 0)]))),
        timeout=RAY_TIMEOUT_S,
    )
    second = ray.put(trajectories_to_batch(make_group("b", 2)))
    assert ray.get(actor.append.remote(second, 0.0), timeout=RAY_TIMEOUT_S) is False  # no room now
    assert ray.get(actor.append.remote(second, 0.2), timeout=RAY_TIMEOUT_S) is False  # timed out
    partial = trajectories_to_batch([make_traj("p", 0, status=TrajectoryStatus.PARTIAL)])
    assert ray.get(actor.append.remote(partial, 0.0), timeout=RAY_TIMEOUT_S) is True  # partial rows never wait
    waiting = actor.append.remote(second, 30.0)
    ready, _ = ray.wait([waiting], timeout=0.5)
    assert not ready  # blocked on capacity
    assert ray.get(actor.sample.remote(0, 1), timeout=RAY_TIMEOUT_S).trajectory_ids == ["a/0", "a/1"]
    assert ray.get(waiting, timeout=RAY_TIMEOUT_S) is True  # unblocked by the sample (2 live rows left)
    stats = ray.get(actor.stats.remote(), timeout=RAY_TIMEOUT_S)
    assert stats["buffer/backpressure_waits"] == 3 and stats["buffer/backpressure_timeouts"] == 2
    ray.kill(actor)


def test_wait_progress_is_a_long_poll_woken_by_appends_and_samples(ray_cluster):
    """The driver's waits: parked until the change counter passes `after`, woken by an append (and by
    a sample), and back with the same counter after `timeout_s` when nothing happened."""
    ray = ray_cluster
    actor = create_buffer_actor(BufferConfig(batch_size=2, group_size=2))
    start = ray.get(actor.progress.remote(), timeout=RAY_TIMEOUT_S)
    assert ray.get(actor.wait_progress.remote(start.changes, 0.2), timeout=RAY_TIMEOUT_S).changes == start.changes
    waiting = actor.wait_progress.remote(start.changes, 60.0)
    ready, _ = ray.wait([waiting], timeout=0.5)
    assert not ready  # parked: nothing changed
    assert ray.get(actor.append.remote(make_group("a", 2)), timeout=RAY_TIMEOUT_S)
    woken = ray.get(waiting, timeout=RAY_TIMEOUT_S)  # well before its 60 s
    assert woken.changes > start.changes and woken.rows_appended == 2
    waiting = actor.wait_progress.remote(woken.changes, 60.0)
    assert ray.get(actor.sample.remote(0, 1), timeout=RAY_TIMEOUT_S) is not None
    assert ray.get(waiting, timeout=RAY_TIMEOUT_S).changes > woken.changes
    ray.kill(actor)
