"""`BufferDir`: a durable buffer's directory: its single-writer lock, its four logs (trajectories,
consumption, images, journal), its manifest, and the sticky failure of any of them.

`ReplayBuffer` decides *what* is written and when it is acknowledged; this class owns *where*. Opening
takes the lock; recovery reads the manifest, then the consumption log (`consumption`), then the
trajectory log (`trajectories`) and the journal (`journal`), and `start` opens fresh segments (each
process writes its own; the journal's on its first write) and rewrites the manifest. A failed write
or fsync of any log (`buffer.log.LogFailedError`) makes every later `raise_if_failed` raise: nothing
written after it is ever acknowledged.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pyarrow as pa

from streamrl.buffer.images import IMAGES_PREFIX, ImageLog
from streamrl.buffer.journal import JOURNAL_PREFIX, JOURNAL_SCHEMA
from streamrl.buffer.log import LogFailedError, SegmentWriter, read_segments
from streamrl.buffer.manifest import (
    CONSUMED_PREFIX,
    CONSUMPTION_SCHEMA,
    TRAJ_PREFIX,
    DirLock,
    consumption_history,
    read_manifest,
    rollback_record,
    write_manifest,
)
from streamrl.buffer.schema import LEGACY_SCHEMAS, TRAJECTORY_SCHEMA, normalize_batch
from streamrl.buffer.types import RecoveryReport

logger = logging.getLogger(__name__)


class BufferDir:
    def __init__(self, root: Path, *, images: ImageLog, segment_max_bytes: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.images = images
        self.report = RecoveryReport()
        self._segment_max_bytes = segment_max_bytes
        self._lock: DirLock | None = DirLock(root)
        self.traj: SegmentWriter | None = None
        self.cons: SegmentWriter | None = None
        self.journal_log: SegmentWriter | None = None  # opened by the first journal write: most runs have none
        self._old_segments: dict[str, list[dict]] = {TRAJ_PREFIX: [], CONSUMED_PREFIX: [], JOURNAL_PREFIX: []}
        self._manifest_segments = 0  # trajectory segments listed by the last manifest write
        self._manifest_image_segments = 0
        self.error: BaseException | None = None  # the first failure of a log write: every later call raises
        manifest, problem = read_manifest(root)
        if problem:
            self.report.corrupt.append(problem)
            logger.warning("buffer recovery: %s", problem)
        self.listed: dict[str, list[dict]] = (manifest or {}).get("segments", {})

    def _expected(self, prefix: str) -> dict[str, int]:
        return {s["name"]: s["num_frames"] for s in self.listed.get(prefix, [])}

    # ---------------------------------------------------------------- recovery
    def consumption(self, resume_learner_step: int | None) -> dict[str, list[tuple[int, int]]]:
        """The consumption history that survives rollbacks (and `resume_learner_step`)."""
        seen: Counter[str] = Counter()

        def batches() -> Iterator[pa.RecordBatch]:
            for name, batch in read_segments(
                self.root,
                prefix=CONSUMED_PREFIX,
                schema=CONSUMPTION_SCHEMA,
                report=self.report,
                expected=self._expected(CONSUMED_PREFIX),
            ):
                seen[name] += 1
                self.report.num_consumption_records += batch.num_rows
                yield batch

        history = consumption_history(batches(), resume_learner_step)
        self._old_segments[CONSUMED_PREFIX] = [{"name": n, "num_frames": k} for n, k in seen.items()]
        return history

    def recover_images(self) -> None:
        self.images.recover(self.report, self._expected(IMAGES_PREFIX))

    def trajectories(self) -> Iterator[pa.RecordBatch]:
        """Every verified trajectory frame, in write order, in `TRAJECTORY_SCHEMA`."""
        for batch in self._frames(TRAJ_PREFIX, TRAJECTORY_SCHEMA, legacy_schemas=LEGACY_SCHEMAS):
            if not batch.schema.equals(TRAJECTORY_SCHEMA):
                batch = normalize_batch(batch)  # an older schema version: adds attempt 0 / empty image columns
            self.report.num_rows += batch.num_rows
            yield batch

    def journal(self) -> Iterator[pa.RecordBatch]:
        """Every verified journal frame, in write order."""
        yield from self._frames(JOURNAL_PREFIX, JOURNAL_SCHEMA)

    def _frames(self, prefix: str, schema: pa.Schema, **kw: Any) -> Iterator[pa.RecordBatch]:
        """The verified frames of one log, in write order; afterwards its old segments are recorded
        (name, frames) for the manifest this process writes."""
        seen: Counter[str] = Counter()
        for name, batch in read_segments(
            self.root, prefix=prefix, schema=schema, report=self.report, expected=self._expected(prefix), **kw
        ):
            seen[name] += 1
            yield batch
        self._old_segments[prefix] = [{"name": n, "num_frames": k} for n, k in seen.items()]

    def start(self, resume_learner_step: int | None) -> None:
        """Open this process's segments, record a consumption rollback, write the manifest (fsync'd)."""
        self.traj = SegmentWriter(
            self.root, prefix=TRAJ_PREFIX, schema=TRAJECTORY_SCHEMA, segment_max_bytes=self._segment_max_bytes
        )
        self.traj.open()  # its directory fsync happens here, not in the first append
        self.cons = SegmentWriter(
            self.root, prefix=CONSUMED_PREFIX, schema=CONSUMPTION_SCHEMA, segment_max_bytes=self._segment_max_bytes
        )
        if resume_learner_step is not None:
            logger.info("rolling back consumption recorded after learner step %d", resume_learner_step)
            self.cons.write(rollback_record(resume_learner_step))
        self.write_manifest(sync=True)
        report = self.report
        if report.num_segments:
            for line in report.lines():
                (logger.info if report.clean else logger.warning)("buffer recovery: %s", line)

    # ---------------------------------------------------------------- writing
    def _writers(self) -> tuple[SegmentWriter, SegmentWriter]:
        """The trajectory and consumption writers, which `start` opens before anything is written."""
        assert self.traj is not None and self.cons is not None, "BufferDir.start() was not called"
        return self.traj, self.cons

    def submit(self, frame: pa.RecordBatch) -> Future[None]:
        traj, _ = self._writers()
        return traj.submit(frame)

    def write_consumption(self, records: pa.RecordBatch) -> None:
        _, cons = self._writers()
        cons.write(records)

    def write_journal(self, records: pa.RecordBatch, *, fsync: bool) -> None:
        """Write journal records in the caller's thread (they are small) and flush them to the OS; with
        `fsync`, fsync them too. A failure fails the directory for good (`buffer.log`)."""
        if self.journal_log is None:
            self.journal_log = SegmentWriter(
                self.root, prefix=JOURNAL_PREFIX, schema=JOURNAL_SCHEMA, segment_max_bytes=self._segment_max_bytes
            )
        segments = len(self.journal_log.segments)
        try:
            self.journal_log.write(records)
            if fsync:
                self.journal_log.sync()
        except LogFailedError as e:
            self.fail(e)
            raise
        if len(self.journal_log.segments) != segments:
            self.write_manifest(sync=False)

    def fail(self, error: BaseException) -> None:
        self.error = self.error or error

    def raise_if_failed(self) -> None:
        """LogFailedError if any log failed (sticky: the buffer is done; see `buffer.log`)."""
        if self.error is None:
            logs = (self.traj, self.cons, self.images, self.journal_log)
            failed = [w.error for w in logs if w is not None and w.error]
            self.error = failed[0] if failed else None
        if self.error is None:
            return
        if isinstance(self.error, LogFailedError):
            raise self.error
        raise LogFailedError(f"buffer log failed: {self.error}; the buffer accepts no more writes") from self.error

    def flushed(self) -> None:
        """After a flush: rewrite the manifest if a log rolled to a new segment."""
        traj, _ = self._writers()
        if (
            len(traj.segments) != self._manifest_segments
            or self.images.num_segments_written != self._manifest_image_segments
        ):
            self.write_manifest(sync=False)

    def sync_rows(self) -> None:
        """fsync the image log, then the row log (rows reference images): a durable append that must
        survive a power loss. A failed fsync fails the directory for good (`buffer.log`)."""
        for log in (self.images, self.traj):
            if log is not None:
                try:
                    log.sync()
                except LogFailedError as e:
                    self.fail(e)
                    raise

    def sync(self, *, fsync: bool) -> None:
        """Checkpoint: fsync the logs (images first: rows reference them) when `fsync`, write the manifest."""
        if fsync:
            traj, cons = self._writers()
            for log in (self.images, traj, cons, self.journal_log):
                if log is not None:
                    log.sync()
        self.write_manifest(sync=fsync)

    def close(self, *, fsync: bool) -> None:
        """Seal the logs and write the manifest (a failed directory only closes its files), then
        release the lock, whatever happened. Closing a closed directory does nothing."""
        if self._lock is None:
            return
        try:
            for log in (self.images, self.traj, self.cons, self.journal_log):
                if log is not None:
                    log.close()
            if self.error is None:
                self.write_manifest(sync=fsync)
        finally:
            self.release()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def write_manifest(self, *, sync: bool) -> None:
        segments = {}
        self._manifest_segments = len(self.traj.segments) if self.traj else 0
        logs = ((TRAJ_PREFIX, self.traj), (CONSUMED_PREFIX, self.cons), (JOURNAL_PREFIX, self.journal_log))
        for prefix, writer in logs:
            current = [{"name": s.name, "num_frames": s.num_frames} for s in writer.segments] if writer else []
            if prefix != JOURNAL_PREFIX or self._old_segments[prefix] or current:  # a run without one: unchanged
                segments[prefix] = self._old_segments[prefix] + current
        self._manifest_image_segments = self.images.num_segments_written
        if self.images.segments:  # a text-only run's manifest is unchanged
            segments[IMAGES_PREFIX] = self.images.segments
        write_manifest(self.root, segments, sync=sync)
