"""`BufferActor`: the replay buffer as a Ray async actor shared by rollout workers and the learner.

Rollout workers append record batches through the object store, not pickled row lists:

    ref = ray.put(trajectories_to_batch(trajs))     # Arrow buffers go to the object store once
    ok = ray.get(actor.append.remote(ref), timeout=...)

Ray resolves the ref to a zero-copy view of the object store; the actor copies it into its own heap
before keeping it (a long-lived reference would pin object-store memory). The learner calls
`sample`.

Backpressure (when `capacity_rows` live rows are held): `append` *awaits* until samples or
evictions make room, up to `timeout_s`, and returns False if the rows were not accepted in time
(the caller keeps them and retries); a timeout of 0 never waits. Only rows that add live rows wait: a
finished row replacing its trajectory's partial row needs no room (refusing it would deadlock a full
buffer whose rows are all in-flight work). Partial rows are always accepted at once: they are parked
in-flight work that admission already counted (`capacity` keeps admission within `capacity_rows`),
and blocking them would stall the weight-sync interrupt behind the learner.

Images travel in the same call as the rows that reference them (`images=`, a list of `ImageBlob`:
hash, mime, size, encoded bytes; tens of KB each), so the bytes are durable before the rows.

Calls run one at a time on the actor's event loop, so the `ReplayBuffer` needs no lock. A background
task flushes on the `flush_every_ms` timer; if it ever fails, the next call raises its error.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from streamrl.buffer import arrow_compute as pc
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.schema import normalize_batch, trajectories_to_batch
from streamrl.buffer.store import ReplayBuffer
from streamrl.buffer.types import BufferProgress, ImageBlob, SampledBatch, SettledGroups
from streamrl.core import trace
from streamrl.rollout.types import JournalRecord, Trajectory, TrajectoryStatus

if TYPE_CHECKING:
    import ray

logger = logging.getLogger(__name__)


def _owned(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A heap copy of a batch that may live in the object store."""
    return batch.take(pa.array(np.arange(batch.num_rows)))


class BufferActor:
    def __init__(self, cfg: BufferConfig, resume_learner_step: int | None = None) -> None:
        self.cfg = cfg
        self.buffer = ReplayBuffer(self.cfg, resume_learner_step=resume_learner_step)
        self._room = asyncio.Condition()
        self._changed = asyncio.Condition()  # notified after every append and sample
        self._flusher: asyncio.Task | None = None
        self.num_backpressure_waits = 0
        self.num_backpressure_timeouts = 0

    def _check_flusher(self) -> None:
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        elif self._flusher.done():
            self._flusher.result()  # re-raises the background failure

    async def _flush_loop(self) -> None:
        """Consumes nothing, waits on the timer; flushes queued rows when `flush_every_ms` elapses."""
        period = self.cfg.flush_every_ms / 1000.0 / 2
        while True:
            await asyncio.sleep(period)
            self.buffer.poll()

    @staticmethod
    def _as_batch(data: pa.RecordBatch | pa.Table | list[Trajectory]) -> pa.RecordBatch:
        if isinstance(data, list):
            return trajectories_to_batch(data)
        return normalize_batch(_owned(data))  # copy first: the stamp then covers the kept buffers

    @staticmethod
    def _all_partial(batch: pa.RecordBatch) -> bool:
        return bool(pc.all(pc.equal(batch.column("status"), TrajectoryStatus.PARTIAL.value)).as_py())

    async def append(
        self,
        data: pa.RecordBatch | pa.Table | list[Trajectory],
        timeout_s: float | None = 30.0,
        durable: bool = False,
        images: list[ImageBlob] | None = None,
    ) -> bool:
        """Append rows, awaiting room under backpressure (None = wait as long as it takes); False if
        they were not accepted within `timeout_s`. `durable=True`: True only once they are in the log.
        `images`: bytes of the images the rows reference (see `ReplayBuffer.append`)."""
        from streamrl.core.faults import ahit

        await ahit("buffer.append")
        self._check_flusher()
        batch = self._as_batch(data)
        if not self._all_partial(batch) and not self._fits(batch):
            self.num_backpressure_waits += 1
            async with self._room:
                try:
                    await asyncio.wait_for(self._room.wait_for(lambda: self._fits(batch)), timeout_s)
                except TimeoutError:
                    self.num_backpressure_timeouts += 1
                    return False
        self.buffer.append(batch, images=images, durable=durable)
        if trace.enabled():
            _trace_appended(batch, durable)
        await self._notify_changed()
        return True

    async def append_journal(self, records: list[JournalRecord]) -> None:
        """Append journal records of running trajectories; returns once they are durable (never
        backpressured: they continue work admission already counted). ValueError: refused, see
        `ReplayBuffer.append_journal`."""
        self._check_flusher()
        self.buffer.append_journal(records)

    async def journal(self, trajectory_id: str) -> list[JournalRecord]:
        """A running trajectory's journal records, in order (what its resumed attempt folds)."""
        return self.buffer.journal(trajectory_id)

    def _fits(self, batch: pa.RecordBatch) -> bool:
        return self.buffer.has_room(self.buffer.num_new_rows(batch))

    async def get_images(self, sha256s: list[str]) -> list[bytes]:
        """Encoded bytes of stored images, in the order asked (resume of a parked image trajectory)."""
        return [self.buffer.get_image(sha) for sha in sha256s]

    async def sample(self, served_version: int, learner_step: int) -> SampledBatch | None:
        self._check_flusher()
        out = self.buffer.sample(served_version=served_version, learner_step=learner_step)
        if out is not None and trace.enabled():
            for tid, lag in zip(out.trajectory_ids, out.lags.tolist()):
                trace.instant("sampled", "trajectory", tid, learner_step=learner_step, lag=lag)
        async with self._room:
            self._room.notify_all()
        await self._notify_changed()
        return out

    async def _notify_changed(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def sample_counted(self, served_version: int, learner_step: int) -> tuple[int, SampledBatch | None]:
        """`sample`, and its number of trajectories (0: none ready) first: called with
        `num_returns=2`, the caller learns whether there is a batch without fetching it."""
        out = await self.sample(served_version, learner_step)
        return (0 if out is None else out.table.num_rows), out

    async def resumable(self, trajectory_ids: list[str] | None = None) -> list[Trajectory]:
        return self.buffer.resumable(trajectory_ids)

    async def resumable_ids(self) -> list[str]:
        return self.buffer.resumable_ids()

    async def has_groups(self, group_ids: list[str]) -> list[bool]:
        return self.buffer.has_groups(group_ids)

    async def settled_groups(self, start: int) -> SettledGroups:
        """The rewards of the groups settled since the `start`-th one (the driver's prompt filter)."""
        return self.buffer.settled_groups(start)

    async def progress(self) -> BufferProgress:
        """Trajectories in flight and rows appended so far: cheap, for the driver's stall checks."""
        return BufferProgress(
            in_flight=self.buffer.num_in_flight,
            rows_appended=self.buffer.num_rows_appended,
            changes=self.buffer.num_changes,
        )

    async def wait_progress(self, after: int, timeout_s: float) -> BufferProgress:
        """Long-poll: `progress()` as soon as the change counter passes `after` (a row arrived, a batch
        was sampled, an over-age group retired), or after `timeout_s` if nothing changed. The driver
        waits here instead of polling on a timer, so a ready batch or freed capacity is acted on at once."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.buffer.num_changes > after), timeout_s)
            except TimeoutError:
                pass
        return await self.progress()

    async def max_policy_version(self) -> int:
        """Highest policy_version label in the buffer (recovered or appended); -1 if none."""
        return self.buffer.max_policy_version

    async def num_ready(self) -> int:
        return self.buffer.num_ready()

    async def capacity(self, served_step: int, max_concurrent: int | None = None) -> int:
        return self.buffer.capacity(served_step=served_step, max_concurrent=max_concurrent)

    async def stats(self) -> dict[str, float]:
        out = self.buffer.stats()
        out["buffer/backpressure_waits"] = float(self.num_backpressure_waits)
        out["buffer/backpressure_timeouts"] = float(self.num_backpressure_timeouts)
        return out

    async def node_id(self) -> str:
        """The Ray node this actor runs on (the driver records placement in RUN_DIR/placement.json)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def memory(self) -> dict[str, float]:
        """`memory/buffer_peak_gb`: this part's peak since it started (`core.memory.part_memory`)."""
        from streamrl.core.memory import part_memory

        return part_memory("buffer")

    async def checkpoint(self) -> None:
        self.buffer.checkpoint()

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        self.buffer.close()


def _trace_appended(batch: pa.RecordBatch, durable: bool) -> None:
    """The lifecycle trace's `appended` instants: one per row, with its status and attempt."""
    columns = ("trajectory_id", "status", "attempt", "min_policy_version", "max_policy_version")
    rows = zip(*(batch.column(c).to_pylist() for c in columns))
    for tid, status, attempt, lo, hi in rows:
        trace.instant(
            "appended",
            "trajectory",
            tid,
            status=status,
            attempt=attempt,
            min_version=lo,
            max_version=hi,
            durable=durable,
        )


def create_buffer_actor(
    cfg: BufferConfig, *, resume_learner_step: int | None = None, **options: Any
) -> ray.actor.ActorHandle:
    """Start a `BufferActor` (default `num_cpus=0`: it is I/O bound; pass Ray options to override)."""
    import ray

    options.setdefault("num_cpus", 0)
    options.setdefault("max_concurrency", 64)
    handle = ray.remote(BufferActor).options(**options).remote(cfg, resume_learner_step)
    # Ray types `remote()` as "a handle or the class itself" (so that method calls type-check); it is a handle
    assert isinstance(handle, ray.actor.ActorHandle)
    return handle
