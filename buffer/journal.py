"""The buffer's journal table: the `JournalRecord`s of running trajectories, and their log schema.

A loop that must make a step durable before it acts on it (the gateway answering a call) appends one
small record instead of writing the whole trajectory again as a partial row, so what a trajectory
writes grows with its steps, not with their square. `ReplayBuffer.append_journal` checks records
against the trajectory's rows (`check`), writes them to the `journal` log and keeps them here until the
trajectory's final row arrives (`drop`); a resumed attempt reads them (`records`). Recovery re-reads the
log and keeps the records of trajectories that are still resumable (`keep_only`).
"""

from __future__ import annotations

import logging

import pyarrow as pa

from streamrl.rollout.types import JournalRecord

logger = logging.getLogger(__name__)

JOURNAL_PREFIX = "journal"
JOURNAL_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("attempt", pa.int64(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("payload", pa.string(), nullable=False),
    ]
)


def records_to_batch(records: list[JournalRecord]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "trajectory_id": [r.trajectory_id for r in records],
            "attempt": [r.attempt for r in records],
            "seq": [r.seq for r in records],
            "payload": [r.payload for r in records],
        },
        schema=JOURNAL_SCHEMA,
    )


def batch_to_records(batch: pa.RecordBatch) -> list[JournalRecord]:
    columns = [batch.column(name).to_pylist() for name in JOURNAL_SCHEMA.names]
    return [JournalRecord(trajectory_id=t, attempt=a, seq=s, payload=p) for t, a, s, p in zip(*columns)]


class JournalTable:
    """The records of each running trajectory, in `seq` order."""

    def __init__(self) -> None:
        self._records: dict[str, list[JournalRecord]] = {}
        self.nbytes = 0  # payload bytes held

    def check(self, records: list[JournalRecord], current_attempt: dict[str, int | None]) -> None:
        """ValueError, changing nothing, unless every record continues its trajectory's journal: the
        trajectory is running (`current_attempt` maps it to its current attempt, None when it has no
        partial row), the record's attempt is not older, and its `seq` is the next one."""
        next_seq: dict[str, int] = {}
        for r in records:
            attempt = current_attempt.get(r.trajectory_id)
            if attempt is None:
                raise ValueError(f"journal record of trajectory {r.trajectory_id}: it is not running (no partial row)")
            if r.attempt < attempt:
                raise ValueError(
                    f"journal record of trajectory {r.trajectory_id} refused: its attempt {r.attempt} is older "
                    f"than the current attempt {attempt} (a worker the driver already replaced)"
                )
            want = next_seq.get(r.trajectory_id, len(self._records.get(r.trajectory_id, ())))
            if r.seq != want:
                raise ValueError(f"journal record {r.seq} of trajectory {r.trajectory_id}: the next one is {want}")
            next_seq[r.trajectory_id] = want + 1

    def add(self, records: list[JournalRecord]) -> None:
        """Keep checked records (or recovered ones: a record that repeats a seq is a duplicate, skipped)."""
        for r in records:
            held = self._records.setdefault(r.trajectory_id, [])
            if r.seq != len(held):
                logger.warning("journal of %s: record %d skipped (%d held)", r.trajectory_id, r.seq, len(held))
                continue
            held.append(r)
            self.nbytes += len(r.payload)

    def records(self, trajectory_id: str) -> list[JournalRecord]:
        return list(self._records.get(trajectory_id, ()))

    def drop(self, trajectory_ids: list[str]) -> None:
        """Forget finished (or failed) trajectories' records: nothing resumes them any more."""
        for tid in trajectory_ids:
            held = self._records.pop(tid, None)
            if held:
                self.nbytes -= sum(len(r.payload) for r in held)

    def keep_only(self, trajectory_ids: set[str]) -> None:
        self.drop([tid for tid in self._records if tid not in trajectory_ids])

    @property
    def num_records(self) -> int:
        return sum(len(held) for held in self._records.values())
