"""The buffer's journal of running trajectories: records are durable when `append_journal` returns and
come back after a restart; they are fenced like rows (an older attempt, a trajectory that is not
running, a gap in `seq` are refused, changing nothing); a final row ends them, a stale one does not."""

from __future__ import annotations

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import AgentData, JournalRecord, TrajectoryStatus


def _row(tid: str, status: TrajectoryStatus = TrajectoryStatus.PARTIAL, attempt: int = 0):
    data = AgentData(trajectory_id=tid, group_id="g", messages=[{"role": "user", "content": "hi"}], attempt=attempt)
    if status is not TrajectoryStatus.PARTIAL:
        data.prompt_ids, data.response_ids = [1, 2], [3]
        data.response_mask, data.behavior_logprobs, data.policy_versions = [1], [-0.5], [0]
    return data.to_trajectory(status)


def _rec(tid: str, seq: int, attempt: int = 0) -> JournalRecord:
    return JournalRecord(trajectory_id=tid, attempt=attempt, seq=seq, payload=f'{{"call": {seq}}}')


def _buffer(root) -> ReplayBuffer:
    return ReplayBuffer(BufferConfig(root_dir=str(root), batch_size=2, group_size=2, fsync_durable_appends=False))


def test_records_are_kept_in_order_and_recovered_after_a_restart(tmp_path):
    buffer = _buffer(tmp_path)
    buffer.append([_row("g/0"), _row("g/1")], durable=True)  # admission
    buffer.append_journal([_rec("g/0", 0)])
    buffer.append_journal([_rec("g/0", 1), _rec("g/1", 0)])
    assert [r.seq for r in buffer.journal("g/0")] == [0, 1] and len(buffer.journal("g/1")) == 1
    buffer._dir.release()  # killed: nothing closed, nothing flushed after the appends returned
    again = _buffer(tmp_path)
    assert again.journal("g/0") == [_rec("g/0", 0), _rec("g/0", 1)] and again.journal("g/1") == [_rec("g/1", 0)]
    again.append_journal([_rec("g/0", 2)])  # and the journal goes on where it was
    again.close()


def test_refused_records_change_nothing(tmp_path):
    buffer = _buffer(tmp_path)
    buffer.append([_row("g/0")], durable=True)
    buffer.append_journal([_rec("g/0", 0)])
    with pytest.raises(ValueError, match="next one is 1"):
        buffer.append_journal([_rec("g/0", 2)])  # a gap
    with pytest.raises(ValueError, match="not running"):
        buffer.append_journal([_rec("g/9", 0)])  # no row
    buffer.append([_row("g/0", attempt=1)], durable=True)  # the driver resubmitted it
    with pytest.raises(ValueError, match="older than the current attempt 1"):
        buffer.append_journal([_rec("g/0", 1, attempt=0)])  # the dead worker's late answer
    with pytest.raises(ValueError, match="record 3 of trajectory g/0: the next one is 2"):
        buffer.append_journal([_rec("g/0", 1, attempt=1), _rec("g/0", 3, attempt=1)])  # all or nothing
    assert buffer.journal("g/0") == [_rec("g/0", 0)]
    buffer.append_journal([_rec("g/0", 1, attempt=1)])
    assert [r.attempt for r in buffer.journal("g/0")] == [0, 1]
    buffer.close()


def test_a_final_row_ends_the_journal_but_a_stale_one_does_not(tmp_path):
    buffer = _buffer(tmp_path)
    buffer.append([_row("g/0"), _row("g/1")], durable=True)
    buffer.append([_row("g/0", attempt=1)], durable=True)
    buffer.append_journal([_rec("g/0", 0, attempt=1), _rec("g/1", 0)])
    buffer.append([_row("g/0", TrajectoryStatus.FAILED, attempt=0)])  # refused: a replaced worker's
    assert len(buffer.journal("g/0")) == 1
    buffer.append([_row("g/0", TrajectoryStatus.FINISHED, attempt=1)])
    assert buffer.journal("g/0") == [] and len(buffer.journal("g/1")) == 1
    with pytest.raises(ValueError, match="not running"):
        buffer.append_journal([_rec("g/0", 1, attempt=1)])
    buffer.close()
    again = _buffer(tmp_path)  # recovery keeps only the journals of trajectories still running
    assert again.journal("g/0") == [] and len(again.journal("g/1")) == 1
    again.close()
