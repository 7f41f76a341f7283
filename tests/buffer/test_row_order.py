"""Which row of a trajectory counts: a terminal row is final (a stale partial row or a duplicate finish
never replaces it, live or after recovery), and replay trains exactly the rows the buffer kept, in
the order each batch had."""

from __future__ import annotations

import gc
from pathlib import Path

from streamrl.buffer import cli
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import TrajectoryStatus
from streamrl.streaming.replay import logged_batches
from tests.buffer.helpers import make_group, make_traj

P = TrajectoryStatus.PARTIAL


def _cfg(root: Path | None, **kw) -> BufferConfig:
    kw.setdefault("batch_size", 2)
    kw.setdefault("group_size", 2)
    return BufferConfig(root_dir=None if root is None else str(root), **kw)


def test_a_stale_partial_row_never_replaces_a_finished_row(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append([make_traj("a", 0, status=P), make_traj("a", 1, status=P)], durable=True)  # admission
    buf.append([make_traj("a", 0, reward=1.0)])
    buf.append([make_traj("a", 0, status=P, num_response=2)], durable=True)  # a killed worker's late park
    assert buf.resumable_ids() == ["a/1"]  # a/0 is finished, not resumable again
    assert buf.stats()["buffer/late_rows_ignored"] == 1
    del buf  # a crash: recovery replays the same rows in the same order
    gc.collect()
    buf = ReplayBuffer(_cfg(tmp_path))
    assert buf.resumable_ids() == ["a/1"]
    buf.append([make_traj("a", 1)])
    batch = buf.sample(served_version=0, learner_step=1)
    assert batch.trajectory_ids == ["a/0", "a/1"] and batch.table.column("status").to_pylist() == ["finished"] * 2
    buf.close()
    latest = cli.load_frame(tmp_path).query("is_latest")
    assert sorted(zip(latest["trajectory_id"], latest["status"])) == [("a/0", "finished"), ("a/1", "finished")]


def test_a_duplicate_finish_keeps_the_first_finished_row():
    buf = ReplayBuffer(_cfg(None, batch_size=4, group_size=4))
    buf.append([make_traj("a", 0, reward=1.0)])
    buf.append([make_traj("a", 0, reward=0.0)])  # a retried worker finishing the same trajectory again
    buf.append([make_traj("a", 1, status=TrajectoryStatus.FAILED)])
    buf.append([make_traj("a", 1, reward=5.0)])  # failed is final too
    buf.append([make_traj("a", i) for i in (2, 3)])
    batch = buf.sample(served_version=0, learner_step=1)
    assert batch.trajectory_ids == ["a/0", "a/2", "a/3"]
    assert batch.table.column("reward").to_pylist()[0] == 1.0
    assert buf.stats()["buffer/late_rows_ignored"] == 2


def test_replay_trains_the_row_the_buffer_kept_not_a_late_duplicate(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append(make_group("a", 2, rewards=[1.0, 0.0]))
    trained = buf.sample(served_version=0, learner_step=1)
    buf.append([make_traj("a", 0, reward=7.0)])  # a late duplicate after consumption: ignored
    assert buf.stats()["buffer/late_rows_ignored"] == 1
    buf.close()
    ((step, rows, lags),) = logged_batches(tmp_path)
    assert step == 1 and rows.column("trajectory_id").to_pylist() == trained.trajectory_ids
    assert rows.column("reward").to_pylist() == [1.0, 0.0] and lags.tolist() == [0, 0]


def test_replay_after_a_rollback_follows_the_batch_the_step_got_the_second_time(tmp_path):
    cfg = _cfg(tmp_path, batch_size=4, group_size=2)
    buf = ReplayBuffer(cfg)
    for g in "ABCD":
        buf.append(make_group(g, 2))
    for step in (1, 2):
        buf.sample(served_version=0, learner_step=step)  # FIFO: [A, B], then [C, D]
    buf.close()
    # The learner's checkpoint is step 1: step 2 is rolled back and trained again, here in another order.
    buf = ReplayBuffer(_cfg(tmp_path, batch_size=4, group_size=2, sampling="uniform", seed=3), resume_learner_step=1)
    again = buf.sample(served_version=0, learner_step=2)
    assert again.trajectory_ids == ["D/0", "D/1", "C/0", "C/1"]
    buf.close()
    batches = logged_batches(tmp_path)
    assert [step for step, _, _ in batches] == [1, 2]
    assert batches[0][1].column("trajectory_id").to_pylist() == ["A/0", "A/1", "B/0", "B/1"]
    assert batches[1][1].column("trajectory_id").to_pylist() == again.trajectory_ids
