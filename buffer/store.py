"""`ReplayBuffer`: the in-memory trajectory store, its durable log, and the learner's sampling.

Data flow: `append` normalizes rows into `TRAJECTORY_SCHEMA` (a batch stamped as validated by its
producer is only re-checksummed), keeps the record batch in the row store (no copy), updates group
bookkeeping (supersession fenced by each row's `attempt`, completion, DAPO filter) and hands the
batch to the log's background writer thread at once; batches smaller than `coalesce_below_rows` are
held and coalesced into one chunk / one frame first. Frames reach the log in append order. Every
`flush_every_rows` rows / `flush_every_ms` ms (checked on every call; the Ray actor also polls)
`flush` waits until every appended row is written: that is when rows are acknowledged as durable,
exactly as without the thread; writing them earlier only overlaps the I/O with the next appends.
`sample` picks whole READY groups within the staleness bound, writes their consumption to the
consumption log *before* returning them, and frees their rows once used `reuse` times. Constructing
a buffer on an existing `root_dir` recovers it (and starts a fresh log segment): the consumption log
is replayed first, then every verified trajectory frame, so nothing consumed is handed out again and
nothing unconsumed is skipped. If the learner restarts from an older checkpoint, pass
`resume_learner_step` and consumption recorded after that step is rolled back (durably). The
directory itself (lock, logs, manifest, a failed write's sticky error) is
`buffer.durable.BufferDir`.

Journal: a running trajectory may also append `JournalRecord`s (`append_journal`: durable when it
returns, fenced by attempt like rows), one per step it must make durable before acting on it, instead
of a whole partial row each time; they are kept (`journal`) until the trajectory's final row arrives
and recovered with the rows (`buffer/journal.py`).

Images: rows reference images by sha256 (`image_refs`); their bytes come with the `append` call and
go to the write-once image log (`buffer/images.py`) before the rows go anywhere; `sample` attaches
them (`SampledBatch.images`). Trajectory segments of schema "1" recover with empty image columns,
those of "1" and "2" with attempt 0 (`buffer.schema`).

Not thread-safe: one caller at a time (the Ray actor serializes calls).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pyarrow as pa

from streamrl.buffer import arrow_compute as pc
from streamrl.buffer.admission import buffer_capacity, length_bucket
from streamrl.buffer.config import BufferConfig, OverAgePolicy
from streamrl.buffer.durable import BufferDir
from streamrl.buffer.groups import GroupPhase, GroupState, GroupTable, RowColumns
from streamrl.buffer.images import ImageLog
from streamrl.buffer.journal import JournalTable, batch_to_records, records_to_batch
from streamrl.buffer.manifest import consume_records
from streamrl.buffer.rows import RowStore
from streamrl.buffer.sampling import choose_groups
from streamrl.buffer.schema import (
    TRAJECTORY_SCHEMA,
    batch_to_trajectories,
    image_refs_of,
    normalize_batch,
    trajectories_to_batch,
)
from streamrl.buffer.stats import BufferStats
from streamrl.buffer.types import GroupOutcome, ImageBlob, RecoveryReport, SampledBatch, SettledGroups
from streamrl.core.versions import trajectory_lag
from streamrl.rollout.types import JournalRecord, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)

_STATUS = {s.value: s for s in TrajectoryStatus}


class ReplayBuffer:
    def __init__(self, cfg: BufferConfig, *, resume_learner_step: int | None = None) -> None:
        self.cfg = cfg
        self._rows = RowStore(compact_below_live_fraction=cfg.compact_below_live_fraction)
        self._groups = GroupTable(
            group_size=cfg.group_size,
            reuse=cfg.reuse,
            min_finished=cfg.min_finished_per_group,
            filter_uniform=cfg.filter_uniform_reward_groups,
        )
        self._rng = np.random.default_rng(cfg.seed)
        self._held_batches: list[pa.RecordBatch] = []  # small batches waiting to be coalesced
        self._held_chunks: list[int] = []  # their row-store chunk ids
        self._inflight: list[Future[None]] = []  # frames handed to the log writer thread
        self._pending_rows = 0  # rows appended since the last flush (not yet acknowledged)
        self._pending_since = 0.0
        self._stats = BufferStats(cfg.max_staleness)
        self._counts = self._stats.counts
        self.max_policy_version = -1  # highest version label of any row ever appended or recovered
        self.recovery_report = RecoveryReport()
        root = Path(cfg.root_dir) if cfg.root_dir is not None else None
        self._images = ImageLog(root, segment_max_bytes=cfg.segment_max_bytes)
        self._journal = JournalTable()
        self._dir: BufferDir | None = None
        if root is not None:
            self._dir = BufferDir(root, images=self._images, segment_max_bytes=cfg.segment_max_bytes)
            self.recovery_report = self._dir.report
            try:
                self._recover(self._dir, resume_learner_step)
            except BaseException:  # e.g. a failed log write: release the directory for the next try
                self._dir.release()
                raise
        elif resume_learner_step is not None:
            raise ValueError("resume_learner_step needs a root_dir: a memory-only buffer has no history")

    # ---------------------------------------------------------------- appending
    def append(
        self,
        data: list[Trajectory] | pa.RecordBatch | pa.Table,
        *,
        images: Iterable[ImageBlob] | None = None,
        durable: bool = False,
    ) -> None:
        """Add finished, partial or failed rows. Never drops data; see `has_room` for backpressure.

        `images`: the encoded bytes of the images the rows reference (`image_refs`); ones the buffer
        already holds may be omitted, extra ones are stored too. They are written to the image log
        (flushed to the OS) before the rows go anywhere. Raises ValueError, changing nothing, if a
        referenced image is neither stored nor supplied or a blob's bytes do not match its hash.

        `durable=True` returns only once the rows are in the log (they survive a process kill) and, with
        `fsync_durable_appends`, fsynced (they survive a power loss): use it when the caller
        acknowledges something on the strength of these rows (admission saves its prompt cursor; a
        tool journal entry lets a side effect run)."""
        self._raise_if_failed()
        batch = trajectories_to_batch(data) if isinstance(data, list) else normalize_batch(data)
        blobs = list(images or ())
        self._images.check_refs(image_refs_of(batch), batch.column("trajectory_id").to_pylist(), blobs)
        self._images.put(blobs)
        if batch.num_rows == 0:
            return
        cid = self._ingest(batch)
        if not self._pending_rows:
            self._pending_since = time.monotonic()
        self._pending_rows += batch.num_rows
        self._counts["rows_appended"] += batch.num_rows
        if batch.num_rows < self.cfg.coalesce_below_rows:
            self._held_batches.append(batch)
            self._held_chunks.append(cid)
        else:
            self._submit_held()
            self._submit(batch)
        if durable:
            self.flush()
            if self._dir is not None and self.cfg.fsync_durable_appends:
                self._dir.sync_rows()
        else:
            self.poll()

    def append_journal(self, records: list[JournalRecord]) -> None:
        """Add journal records of running trajectories; returns once they are in the log (and fsynced,
        with `fsync_durable_appends`), after every row appended before them. Raises ValueError, changing
        nothing, for a record of a trajectory that is not running, of an older attempt than its rows',
        or out of `seq` order (`JournalTable.check`)."""
        self._raise_if_failed()
        self._journal.check(records, {r.trajectory_id: self._groups.partial_attempt(r.trajectory_id) for r in records})
        if self._dir is not None:
            self.flush()  # the rows a record continues are durable before it
            self._dir.write_journal(records_to_batch(records), fsync=self.cfg.fsync_durable_appends)
        self._journal.add(records)

    def journal(self, trajectory_id: str) -> list[JournalRecord]:
        """The journal of a running trajectory, in `seq` order (empty once it finished or failed)."""
        return self._journal.records(trajectory_id)

    def get_image(self, sha256: str) -> bytes:
        """Encoded bytes of a stored image (resume of a parked trajectory, the viewer). KeyError if absent."""
        return self._images.get(sha256)

    def _ingest(self, batch: pa.RecordBatch) -> int:
        """Row store + group bookkeeping for one batch; returns its chunk id. Raises ValueError
        (group overflow) before mutating anything."""
        tids = batch.column("trajectory_id").to_pylist()
        gids = batch.column("group_id").to_pylist()
        statuses = batch.column("status").to_pylist()
        self._groups.check_overflow(tids, gids)
        tokens = (
            batch.column("num_prompt_tokens").to_numpy().astype(np.int64)
            + batch.column("num_response_tokens").to_numpy()
        )
        top = pc.max(batch.column("max_policy_version")).as_py()
        if top is not None and top > self.max_policy_version:
            self.max_policy_version = top
        cid, first = self._rows.add(batch)
        dead = self._groups.apply(
            RowColumns(
                first_row=first,
                trajectory_ids=tids,
                group_ids=gids,
                statuses=[_STATUS[s] for s in statuses],
                sample_index=batch.column("sample_index").to_numpy().tolist(),
                num_tokens=tokens.tolist(),
                rewards=batch.column("reward").to_numpy().tolist(),
                min_policy_versions=batch.column("min_policy_version").to_numpy().tolist(),
                attempts=batch.column("attempt").to_numpy().tolist(),
            )
        )
        if dead:
            self._rows.kill(dead)
        partial = TrajectoryStatus.PARTIAL.value  # a final row ends its journal (unless it was refused as stale)
        ended = [t for t, s in zip(tids, statuses) if s != partial]
        self._journal.drop([t for t in ended if self._groups.partial_attempt(t) is None])
        if self.cfg.max_batch_tokens is not None:
            self._count_oversized(set(gids), self.cfg.max_batch_tokens)
        return cid

    def _count_oversized(self, group_ids: set[str], budget: int) -> None:
        """Groups that became ready larger than the token budget: counted and trained alone, never
        dropped (`buffer.sampling`)."""
        ready = self._groups.ready
        for group in [ready[gid] for gid in group_ids if gid in ready and ready[gid].num_tokens > budget]:
            logger.warning(
                "group %s has %d tokens, over max_batch_tokens %d: it is trained in a batch of its own",
                group.group_id,
                group.num_tokens,
                budget,
            )
            self._counts["groups_over_token_budget"] += 1

    def has_room(self, num_rows: int = 1) -> bool:
        """Whether `num_rows` more live rows fit under `capacity_rows` (callers backpressure, see
        BufferActor). Ask with `num_new_rows(batch)`: rows that replace rows need no room, so a
        finished row replacing its partial row is never refused, however full the buffer is."""
        cap = self.cfg.capacity_rows
        return cap is None or num_rows <= 0 or self._rows.num_live + num_rows <= cap or self._rows.num_live == 0

    def num_new_rows(self, batch: pa.RecordBatch) -> int:
        """The live rows appending `batch` would add (`GroupTable.num_new_trajectories`)."""
        return self._groups.num_new_trajectories(
            batch.column("trajectory_id").to_pylist(), batch.column("group_id").to_pylist()
        )

    # ---------------------------------------------------------------- durability
    def poll(self) -> None:
        """Flush if the row or time threshold of the durability policy is reached."""
        if self._pending_rows and (
            self._pending_rows >= self.cfg.flush_every_rows
            or (time.monotonic() - self._pending_since) * 1000.0 >= self.cfg.flush_every_ms
        ):
            self.flush()

    def flush(self) -> None:
        """Write every appended row to the log and wait for it (to the OS: the rows survive a process
        kill from when this returns). Once a log write failed, this and every later call raises
        `LogFailedError` (the rows written since the last flush are never acknowledged)."""
        self._raise_if_failed()
        if not self._pending_rows and not self._inflight:
            return
        self._submit_held()
        inflight, self._inflight = self._inflight, []
        errors = [e for e in (f.exception() for f in inflight) if e is not None]
        if errors:
            assert self._dir is not None, "only a durable buffer has log writes in flight"
            self._dir.fail(errors[0])
            self._dir.raise_if_failed()
        if self._dir is not None:
            self._dir.flushed()
        self._counts["flushes"] += 1
        self._pending_rows = 0

    def _raise_if_failed(self) -> None:
        if self._dir is not None:
            self._dir.raise_if_failed()

    def _submit_held(self) -> None:
        """Hand the held small batches to the log as one frame (and one row-store chunk)."""
        frames, chunks = self._held_batches, self._held_chunks
        if not frames:
            return
        self._held_batches, self._held_chunks = [], []
        if len(frames) > 1:
            present = [c for c in chunks if c in self._rows.chunks]
            if len(present) == len(chunks):
                frames = [self._rows.coalesce(present)]
            else:  # some chunks were compacted or released meanwhile: coalesce only the log frame
                frames = pa.Table.from_batches(frames, schema=TRAJECTORY_SCHEMA).combine_chunks().to_batches()
        for frame in frames:
            self._submit(frame)

    def _submit(self, frame: pa.RecordBatch) -> None:
        if self._dir is not None:
            self._inflight.append(self._dir.submit(frame))

    def checkpoint(self) -> None:
        """Flush, then fsync all logs and the manifest (when `fsync_on_checkpoint`)."""
        self.flush()
        if self._dir is not None:
            self._dir.sync(fsync=self.cfg.fsync_on_checkpoint)

    def close(self) -> None:
        """Flush, seal the logs, write the manifest, release the directory. A failed buffer raises
        its LogFailedError after closing its files and releasing the directory (nothing is sealed)."""
        try:
            self.flush()
        finally:
            if self._dir is not None:
                self._dir.close(fsync=self.cfg.fsync_on_checkpoint)

    # ---------------------------------------------------------------- sampling
    def sample(self, *, served_version: int, learner_step: int) -> SampledBatch | None:
        """Whole READY groups within the staleness bound, or None if no complete batch is ready.
        Their consumption at `learner_step` is recorded (durably with a root_dir) before returning.
        A call that finds no batch writes nothing (the driver asks after every append; flushing then
        would cut the log into one frame per append)."""
        self._retire_over_age(served_version)
        while True:
            groups = self._choose(served_version)
            if groups is None:
                return None
            members = [m for g in groups for m in g.finished]
            table = self._rows.take(np.array([m.row for m in members], dtype=np.int64))
            refs = image_refs_of(table)
            if not self._drop_missing_images(groups, refs):  # checked before anything is recorded
                break
        row_lags = trajectory_lag(served_version, table.column("min_policy_version").to_numpy())
        self.flush()  # rows are durable before their consumption is
        self._record_consumption(table, row_lags, learner_step=learner_step, served_version=served_version)
        self._counts["over_age_trained"] += int(np.sum(np.asarray(row_lags) > self.cfg.max_staleness))
        dead: list[int] = []
        for g in groups:
            if g.num_uses == 0:
                self._stats.trained_lengths.update(length_bucket(m.num_tokens) for m in g.finished)
            dead.extend(self._groups.consume(g, learner_step))
        self._rows.kill(dead)
        self._stats.account_batch(table, row_lags, served_version)
        return SampledBatch(
            table=table,
            trajectory_ids=[m.trajectory_id for m in members],
            learner_step=learner_step,
            served_version=served_version,
            lags=np.asarray(row_lags, dtype=np.int64),
            images=self._images.rows(refs),
        )

    def _choose(self, served_version: int) -> list[GroupState] | None:
        """The groups of the next batch (`buffer.sampling.choose_groups`), or None if no complete batch is ready."""
        return choose_groups(self.cfg, self._groups.ready.values(), served_version=served_version, rng=self._rng)

    def _drop_missing_images(self, groups: list[GroupState], refs: list[list[str]]) -> bool:
        """Drop the groups whose rows reference images the image log does not hold (their bytes were
        lost before a restart: a torn or missing image segment); True if any was. Without this the
        batch would fail after its consumption was recorded, on every resume. Each drop is logged as an
        error and counted (`buffer/groups_dropped`, and a line of the recovery report)."""
        missing = set(self._images.missing(r for row in refs for r in row))
        if not missing:
            return False
        bad: list[GroupState] = []
        start = 0
        for g in groups:
            if any(missing.intersection(row) for row in refs[start : start + len(g.finished)]):
                bad.append(g)
            start += len(g.finished)
        for g in bad:
            self._rows.kill(self._groups.retire(g, GroupPhase.DROPPED))
        msg = (
            f"dropped {len(bad)} ready groups ({sum(len(g.finished) for g in bad)} trajectories, first "
            f"{bad[0].group_id}): their rows reference {len(missing)} images missing from the image log "
            f"(first {min(missing)}); they are never sampled"
        )
        logger.error("buffer: %s", msg)
        self.recovery_report.missing.append(msg)
        return True

    def _retire_over_age(self, served_version: int) -> None:
        ready = list(self._groups.ready.values())
        if not ready or self.cfg.over_age is OverAgePolicy.TRAIN:
            return
        lags = trajectory_lag(served_version, np.array([g.min_policy_version for g in ready]))
        over = [g for g, lag in zip(ready, lags.tolist()) if lag > self.cfg.max_staleness]
        if not over:
            return
        keep = self.cfg.over_age is OverAgePolicy.KEEP
        phase = GroupPhase.OVER_AGE if keep else GroupPhase.EVICTED
        for g in over:
            self._stats.dropped_lengths.update(length_bucket(m.num_tokens) for m in g.finished)
            self._rows.kill(self._groups.retire(g, phase))
        num = sum(len(g.finished) for g in over)
        self._counts["over_age_kept" if keep else "evicted_over_age"] += num
        logger.warning(
            "%s %d trajectories in %d groups whose lag exceeds max_staleness=%d at served_version %d",
            "keeping (never sampled)" if keep else "evicting",
            num,
            len(over),
            self.cfg.max_staleness,
            served_version,
        )

    def _record_consumption(self, table: pa.Table, lags: np.ndarray, *, learner_step: int, served_version: int) -> None:
        self._counts["trajectories_consumed"] += table.num_rows
        self._counts["batches_sampled"] += 1
        if self._dir is not None:
            self._dir.write_consumption(consume_records(table, lags, learner_step, served_version))

    # ---------------------------------------------------------------- queries
    def resumable(self, trajectory_ids: list[str] | None = None) -> list[Trajectory]:
        """Trajectories whose latest row is partial (to be resumed from their AgentData), all or
        those of `trajectory_ids` that still are. Each is the partial row of its current attempt
        (`Trajectory.attempt`; a row of an older attempt is never kept)."""
        rows = self._groups.resumable_rows(trajectory_ids)
        return batch_to_trajectories(self._rows.take(np.array(rows, dtype=np.int64))) if rows else []

    def resumable_ids(self) -> list[str]:
        return self._groups.resumable_ids()

    def has_groups(self, group_ids: list[str]) -> list[bool]:
        """Whether each group has any row (admission idempotence after a restart)."""
        return [gid in self._groups.groups for gid in group_ids]

    def settled_groups(self, start: int = 0) -> SettledGroups:
        """The rewards of the groups settled since the `start`-th one (`SettledGroups`): what the
        driver's prompt filter derives each prompt's pass rate from, incrementally while the run goes
        and from 0 after a restart (the recovered log settles every group again)."""
        groups = self._groups.settled[start:]
        return SettledGroups(
            outcomes=[GroupOutcome(group_id=g.group_id, rewards=g.finished_rewards) for g in groups],
            next_start=start + len(groups),
            num_in_flight=self._groups.num_in_flight,
        )

    def num_ready(self) -> int:
        """Finished trajectories in complete groups waiting to be sampled (staleness not applied)."""
        return self._groups.num_ready_trajectories

    @property
    def num_accepted(self) -> int:
        return self._groups.num_accepted

    @property
    def num_in_flight(self) -> int:
        """Admitted trajectories not yet accepted: every member of an open group (partial or finished)."""
        return self._groups.num_in_flight

    @property
    def num_rows_appended(self) -> int:
        return self._counts["rows_appended"]

    @property
    def num_changes(self) -> int:
        """Grows with every append and every sampled batch: the events that can make a batch ready or
        change admission capacity (what the driver's waits long-poll on, `BufferActor.wait_progress`)."""
        return self._counts["rows_appended"] + self._counts["batches_sampled"] + self._counts["evicted_over_age"]

    def capacity(self, *, served_step: int, max_concurrent: int | None = None) -> int:
        """Admission: how many trajectories may start now (see `buffer.admission.rollout_capacity`),
        with the engines serving the weights of learner step `served_step` (a step, not a label).

        Counts come from the buffer itself (every admitted group has rows here from admission on), so
        they survive restarts; `max_concurrent` bounds the trajectories still running (partial rows)
        and `capacity_rows` the live rows (an admitted group's rows are accepted without waiting)."""
        return buffer_capacity(
            self.cfg,
            served_step=served_step,
            num_in_flight=self._groups.num_in_flight,
            num_accepted=self._groups.num_accepted,
            num_partial=self._groups.num_partial,
            num_live_rows=self._rows.num_live,
            max_concurrent=max_concurrent,
            kept_share=self._groups.kept_share(self.cfg.admission_window),
        )

    def memory_bytes(self) -> int:
        return self._rows.nbytes + self._images.nbytes + self._journal.nbytes

    def stats(self) -> dict[str, float]:
        return self._stats.snapshot(
            self._groups,
            live_rows=self._rows.num_live,
            memory_bytes=self.memory_bytes(),
            chunks=len(self._rows.chunks),
            recovery=self.recovery_report,
        )

    # ---------------------------------------------------------------- recovery
    def _recover(self, directory: BufferDir, resume_learner_step: int | None) -> None:
        """Replay the directory: consumption first (so nothing consumed is handed out again), then
        every verified trajectory frame; then start this process's segments."""
        report = self.recovery_report
        history = directory.consumption(resume_learner_step)
        self._counts["trajectories_consumed"] = sum(len(uses) for uses in history.values())
        self._groups.preloaded_steps = {tid: [step for step, _ in uses] for tid, uses in history.items()}
        directory.recover_images()
        for batch in directory.trajectories():
            self._images.note_refs(image_refs_of(batch))
            self._ingest(batch)
        for batch in directory.journal():
            self._journal.add(batch_to_records(batch))
        self._journal.keep_only(set(self._groups.resumable_ids()))
        orphans = len(self._groups.preloaded_steps)
        if orphans:
            msg = f"{orphans} consumption records refer to trajectories whose rows were not recovered"
            report.missing.append(msg)
            logger.warning("buffer recovery: %s", msg)
        self._groups.preloaded_steps = {}
        self._images.report_unresolved(report)
        directory.start(resume_learner_step)


__all__ = ["ReplayBuffer", "SampledBatch", "GroupState"]
