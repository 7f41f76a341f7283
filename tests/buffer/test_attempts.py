"""Rows are fenced by their trajectory's attempt number, so a replaced worker's late rows never
train: a row of an attempt older than the newest the buffer holds for its trajectory (a worker the
driver already replaced, whose append lands late) is refused and counted, live and after recovery
from the log; rows of the current attempt keep the usual rules; a log written before the column
existed reads as attempt 0."""

from __future__ import annotations

import dataclasses
import gc
import logging
from pathlib import Path

import pyarrow as pa
import pytest

from streamrl.buffer import cli
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.log import SegmentWriter
from streamrl.buffer.manifest import TRAJ_PREFIX
from streamrl.buffer.schema import TRAJECTORY_SCHEMA_V2, normalize_batch, trajectories_to_batch
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import AgentData, Trajectory, TrajectoryStatus
from tests.buffer.helpers import make_group, make_traj

P = TrajectoryStatus.PARTIAL
STALE = "buffer/stale_attempt_rows"


def _cfg(root: Path | None, **kw) -> BufferConfig:
    kw.setdefault("batch_size", 2)
    kw.setdefault("group_size", 2)
    return BufferConfig(root_dir=None if root is None else str(root), **kw)


def _row(group_id: str, sample_index: int, *, attempt: int, status=P, num_response: int = 4, **kw) -> Trajectory:
    """A row of `attempt`, its AgentData (partial rows) carrying the same attempt and `num_response`
    response tokens, so that the state each row holds is recognizable."""
    row = make_traj(group_id, sample_index, status=status, num_response=num_response, **kw)
    agent_json = row.agent_data_json
    if agent_json is not None:
        data = AgentData.from_json(agent_json)
        data.attempt = attempt
        data.response_ids = list(row.response_ids)
        agent_json = data.to_json()
    return dataclasses.replace(row, attempt=attempt, agent_data_json=agent_json)


def _resumable(buf: ReplayBuffer) -> dict[str, tuple[int, int, int]]:
    """trajectory -> (row attempt, AgentData attempt, response tokens of its AgentData)."""
    out = {}
    for t in buf.resumable():
        data = t.agent_data()
        out[t.trajectory_id] = (t.attempt, data.attempt, len(data.response_ids))
    return out


def _admit_and_resubmit(buf: ReplayBuffer) -> None:
    buf.append([_row("a", 0, attempt=0, num_response=0), _row("a", 1, attempt=0, num_response=0)], durable=True)
    buf.append([_row("a", 0, attempt=0, num_response=2)])  # worker 1 parks a/0
    # worker 1 is declared dead: the driver records a/0's next attempt before worker 2 gets it
    buf.append([_row("a", 0, attempt=1, num_response=2)], durable=True)
    buf.append([_row("a", 0, attempt=1, num_response=5)], durable=True)  # worker 2 parks a/0 further on


def test_an_older_attempts_partial_row_is_refused_and_counted(caplog):
    buf = ReplayBuffer(_cfg(None))
    _admit_and_resubmit(buf)
    assert _resumable(buf)["a/0"] == (1, 1, 5)
    with caplog.at_level(logging.WARNING, logger="streamrl.buffer.groups"):
        buf.append([_row("a", 0, attempt=0, num_response=7)])  # worker 1's park, landing late
    assert _resumable(buf) == {"a/0": (1, 1, 5), "a/1": (0, 0, 0)}  # attempt 1's state, not worker 1's
    stats = buf.stats()
    assert stats[STALE] == 1 and stats["buffer/late_rows_ignored"] == 0
    assert stats["buffer/partial_trajectories"] == 2 and stats["buffer/in_flight_trajectories"] == 2
    assert any("attempt 0 is older than the current attempt 1" in r.getMessage() for r in caplog.records)
    # worker 1's late finish is refused too; attempt 1's finish is what the group trains on
    buf.append([_row("a", 0, attempt=0, status=TrajectoryStatus.FINISHED, reward=9.0)])
    assert buf.num_ready() == 0 and "a/0" in _resumable(buf)
    buf.append([_row("a", 0, attempt=1, status=TrajectoryStatus.FINISHED, reward=1.0)])
    buf.append([_row("a", 1, attempt=0, status=TrajectoryStatus.FINISHED)])  # a/1's first attempt: current
    batch = buf.sample(served_version=0, learner_step=1)
    assert batch.trajectory_ids == ["a/0", "a/1"]
    assert batch.table.column("reward").to_pylist() == [1.0, 0.0]
    assert batch.table.column("attempt").to_pylist() == [1, 0]
    assert buf.stats()[STALE] == 2


def test_rows_of_the_current_attempt_keep_the_usual_rules():
    buf = ReplayBuffer(_cfg(None))
    _admit_and_resubmit(buf)
    buf.append([_row("a", 0, attempt=1, num_response=3)])  # the same attempt: a later partial replaces
    assert _resumable(buf)["a/0"] == (1, 1, 3)
    buf.append([_row("a", 0, attempt=1, status=TrajectoryStatus.FINISHED, reward=1.0)])
    buf.append([_row("a", 0, attempt=1, num_response=6)])  # after its terminal row: late, not stale
    buf.append([_row("a", 0, attempt=2, num_response=6)])  # a newer attempt cannot reopen it either
    assert "a/0" not in _resumable(buf)
    stats = buf.stats()
    assert stats["buffer/late_rows_ignored"] == 2 and stats[STALE] == 0


def test_the_attempt_is_recovered_from_the_log_and_older_rows_stay_refused(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    _admit_and_resubmit(buf)
    buf.append([_row("a", 0, attempt=0, num_response=7)], durable=True)  # in the log, refused live
    assert buf.stats()[STALE] == 1
    del buf  # a crash: recovery replays the log in order and refuses the same row
    gc.collect()
    buf = ReplayBuffer(_cfg(tmp_path))
    assert _resumable(buf) == {"a/0": (1, 1, 5), "a/1": (0, 0, 0)}
    assert buf.stats()[STALE] == 1
    # the recovered buffer knows a/0 is at attempt 1: the old worker's rows are still refused
    buf.append([_row("a", 0, attempt=0, num_response=8)])
    buf.append([_row("a", 0, attempt=0, status=TrajectoryStatus.FINISHED, reward=9.0)])
    assert _resumable(buf)["a/0"] == (1, 1, 5) and buf.stats()[STALE] == 3
    buf.append(
        [_row("a", i, attempt=a, status=TrajectoryStatus.FINISHED, reward=float(i)) for i, a in ((0, 1), (1, 0))]
    )
    batch = buf.sample(served_version=0, learner_step=1)
    assert batch.table.column("attempt").to_pylist() == [1, 0] and batch.table.column("reward").to_pylist() == [0, 1]
    buf.close()
    # the CLI's "row the buffer kept" follows the same rule
    latest = cli.load_frame(tmp_path).query("is_latest")
    assert sorted(zip(latest["trajectory_id"], latest["attempt"], latest["reward"])) == [
        ("a/0", 1, 0.0),
        ("a/1", 0, 1.0),
    ]


def test_a_log_written_before_attempts_existed_reads_as_attempt_0(tmp_path):
    """Schema "2" (no `attempt` column) recovers with attempt 0 everywhere, and the next process
    fences against it."""
    v3 = trajectories_to_batch([make_traj("old", 0, status=P), make_traj("old", 1, status=P)] + make_group("done", 2))
    v2 = pa.RecordBatch.from_arrays([v3.column(f.name) for f in TRAJECTORY_SCHEMA_V2], schema=TRAJECTORY_SCHEMA_V2)
    writer = SegmentWriter(tmp_path, prefix=TRAJ_PREFIX, schema=TRAJECTORY_SCHEMA_V2, segment_max_bytes=1 << 20)
    writer.write(v2)
    writer.close()
    assert normalize_batch(v2).column("attempt").to_pylist() == [0] * 4
    table, _, report = cli.read_dir(tmp_path)
    assert report.clean and table.column("attempt").to_pylist() == [0] * 4
    buf = ReplayBuffer(_cfg(tmp_path))
    assert buf.recovery_report.clean and buf.recovery_report.num_rows == 4
    assert {t.trajectory_id: t.attempt for t in buf.resumable()} == {"old/0": 0, "old/1": 0}
    buf.append([_row("old", 0, attempt=1, num_response=3)], durable=True)
    buf.append([_row("old", 0, attempt=0, num_response=6)])
    assert _resumable(buf)["old/0"] == (1, 1, 3) and buf.stats()[STALE] == 1
    buf.close()


def test_a_negative_attempt_is_a_contract_error():
    with pytest.raises(ValueError, match="attempt"):
        trajectories_to_batch([dataclasses.replace(make_traj("a", 0), attempt=-1)])
