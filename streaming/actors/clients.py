"""Typed clients of the actors the driver talks to: one small class per actor, whose methods take
and return the records of that part's `types.py` (never JSON strings, never control values inside
metric dicts), each call bounded by a timeout.

    BufferClient   -> streaming.actors.buffer.BufferActor          (admission rows, batches, recovery, stats)
    LearnerClient  -> streaming.actors.learner.LearnerActor (train step, publish, checkpoint)
    WorkerClient   -> streaming.actors.worker.RolloutWorkerActor (submit, pause, routing)

(An engine actor's client is `streaming.actors.engine.RayEngineClient`: the `InferenceEngine` the
workers generate through, and the driver's probe of the actor.)

`Pipeline` holds these, never raw handles, so the driver's loops run in-process against fakes with
the same methods (tests/streaming/test_driver_loops.py). A dead actor raises
`ray.exceptions.RayActorError` and a call past its deadline `asyncio.TimeoutError`, unchanged:
the health checks tell the two apart.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ray

    from streamrl.buffer.types import BufferProgress, ImageBlob, SettledGroups
    from streamrl.rollout.types import AgentData, JournalRecord, RolloutOutcomes, Trajectory
    from streamrl.streaming.actors.engine import RayEngineClient
    from streamrl.streaming.actors.learner import Trained
    from streamrl.streaming.config import ActorTimeouts
    from streamrl.weight_sync.types import Published


class ActorClient:
    """A Ray actor handle and the deadlines of its calls: `timeout_s` for the work itself (a step, a
    publish, an append), `timeouts` (`trainer.actor_timeouts`) for probes, queries and stops."""

    def __init__(
        self, handle: ray.actor.ActorHandle, *, timeout_s: float, timeouts: ActorTimeouts | None = None
    ) -> None:
        from streamrl.streaming.config import ActorTimeouts

        self.handle = handle
        self.timeout_s = timeout_s
        self.timeouts = timeouts or ActorTimeouts()

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        ref = getattr(self.handle, method).remote(*args, **kwargs)
        return await asyncio.wait_for(ref, timeout_s or self.timeout_s)

    async def memory(self) -> dict[str, float]:
        """`memory/<part>_peak_gb` of the actor's process and its children."""
        return await self._call("memory", timeout_s=self.timeouts.probe_s)

    async def node_id(self) -> str:
        return await self._call("node_id", timeout_s=self.timeouts.query_s)

    def kill(self) -> None:
        """End the actor now, without restart (a part too slow to answer must not go on as a zombie)."""
        import ray

        ray.kill(self.handle, no_restart=True)


class BufferClient(ActorClient):
    async def capacity(self, *, served_step: int, max_concurrent: int) -> int:
        """Trajectories that may start now (`buffer.admission.rollout_capacity`); `served_step` is the
        learner step of the served weights (admission counts steps), unlike `sample`'s label."""
        return await self._call("capacity", served_step=served_step, max_concurrent=max_concurrent)

    async def has_group(self, group_id: str) -> bool:
        """Whether the group has any row (admission idempotence across restarts)."""
        (present,) = await self._call("has_groups", [group_id])
        return present

    async def append_durable(self, rows: list[Trajectory]) -> None:
        """Append rows and return once they are in the log (they survive a kill from then on)."""
        import ray

        from streamrl.buffer.schema import trajectories_to_batch

        await self._call("append", ray.put(trajectories_to_batch(rows)), timeout_s=None, durable=True)

    async def append_rows(
        self, rows: list[Trajectory], *, wait_s: float, durable: bool = False, images: list[ImageBlob] | None = None
    ) -> bool:
        """A rollout worker's append: False when the buffer stayed full for `wait_s` (backpressure;
        the caller keeps the rows and retries). `durable`: True only once they are in the log."""
        import ray

        from streamrl.buffer.schema import trajectories_to_batch

        kw = {} if images is None else {"images": images}
        ref = ray.put(trajectories_to_batch(rows))
        return await self._call("append", ref, wait_s, durable, timeout_s=wait_s + self.timeout_s, **kw)

    async def append_journal(self, records: list[JournalRecord]) -> None:
        """Append a running trajectory's journal records; returns once they are durable."""
        await self._call("append_journal", records)

    async def journal(self, trajectory_id: str) -> list[JournalRecord]:
        """A running trajectory's journal records, in `seq` order."""
        return await self._call("journal", trajectory_id)

    async def get_images(self, sha256s: list[str]) -> list[bytes]:
        """Encoded bytes of stored images, in the order asked (a parked image trajectory resumed)."""
        return await self._call("get_images", sha256s)

    async def sample(self, *, served_version: int, learner_step: int) -> ray.ObjectRef | None:
        """A reference to the next batch (it goes from the buffer to the learner, never through the
        driver), or None when no complete batch is ready. Its lags count from `served_version`, the served
        weights' label; its consumption is recorded at `learner_step`."""
        count, batch = self.handle.sample_counted.options(num_returns=2).remote(served_version, learner_step)
        return batch if await asyncio.wait_for(count, self.timeout_s) else None

    async def settled_groups(self, start: int) -> SettledGroups:
        """The rewards of the groups settled since the `start`-th one (`ReplayBuffer.settled_groups`)."""
        return await self._call("settled_groups", start, timeout_s=self.timeouts.query_s)

    async def progress(self) -> BufferProgress:
        return await self._call("progress")

    async def wait_progress(self, after: int, timeout_s: float) -> BufferProgress:
        """`progress()` once the buffer's change counter passes `after`, or after `timeout_s`."""
        return await self._call("wait_progress", after, timeout_s, timeout_s=timeout_s + self.timeout_s)

    async def resumable_ids(self) -> list[str]:
        return await self._call("resumable_ids")

    async def resumable(self, trajectory_ids: list[str]) -> list[Trajectory]:
        return await self._call("resumable", trajectory_ids)

    async def max_policy_version(self) -> int:
        """Highest version label in the buffer; the first call waits for the buffer's recovery."""
        return await self._call("max_policy_version", timeout_s=self.timeouts.recovery_s)

    async def checkpoint(self) -> None:
        await self._call("checkpoint")

    async def stats(self) -> dict[str, float]:
        return await self._call("stats")

    async def close(self) -> None:
        await self._call("close", timeout_s=self.timeouts.stop_s)


class LearnerClient(ActorClient):
    async def train_step(self, batch: ray.ObjectRef) -> Trained:
        return await self._call("train_step", batch)

    async def publish(self) -> Published:
        """The served version, the engines weight sync dropped (they may rejoin at a later sync) and `sync/*`."""
        return await self._call("publish")

    async def start_checkpoint(self, path: str) -> None:
        """The learner snapshots its state for the checkpoint at `path` and writes it in the background."""
        await self._call("start_checkpoint", path)

    async def finish_checkpoint(self) -> str | None:
        """Wait for the checkpoint write in flight: its folder once sealed (None if none), or its error."""
        return await self._call("finish_checkpoint")

    async def checkpoint_busy(self) -> bool:
        return await self._call("checkpoint_busy", timeout_s=self.timeouts.query_s)

    async def policy_version(self) -> int:
        return await self._call("policy_version")

    async def node_ids(self) -> list[str]:
        """The nodes of the training processes (one, or one per rank)."""
        return await self._call("node_ids")

    async def set_policy_version(self, version: int) -> None:
        await self._call("set_policy_version", version)

    async def connect(self, engines: list[RayEngineClient], workers: list[WorkerClient], policy_version: int) -> None:
        await self._call("connect", [e.handle for e in engines], list(workers), policy_version)

    async def add_engines(self, engines: list[RayEngineClient]) -> list[str]:
        """New engines join the weight-sync set (the next sync brings them to its version)."""
        return await self._call("add_engines", [e.handle for e in engines], [e.engine_id for e in engines])

    async def remove_engines(self, engine_ids: list[str]) -> list[str]:
        """Drained or dead engines leave the weight-sync set for good."""
        return await self._call("remove_engines", list(engine_ids))

    async def set_workers(self, workers: list[WorkerClient]) -> None:
        """The rollout workers the publisher pauses (their clients travel to the learner's process)."""
        await self._call("set_workers", list(workers))

    async def shutdown(self) -> None:
        await self._call("shutdown", timeout_s=self.timeouts.stop_s)


class WorkerClient(ActorClient):
    async def submit(self, items: list[AgentData]) -> int:
        """Start or resume these trajectories; returns how many the worker runs now."""
        return await self._call("submit", items)

    async def num_outstanding(self) -> int:
        """Running plus held (paused) trajectories: the cheap liveness call."""
        return await self._call("num_outstanding", timeout_s=self.timeouts.probe_s)

    async def running_ids(self) -> list[str]:
        """Every trajectory the worker holds, from submission until its final row is appended."""
        return await self._call("running_ids", timeout_s=self.timeouts.query_s)

    async def route(self, keep_out: list[str]) -> list[str]:
        return await self._call("route", keep_out, timeout_s=self.timeouts.query_s)

    async def add_engines(self, engines: list[RayEngineClient]) -> None:
        """New engines enter the worker's routing table, out of routing until `route` lets them in."""
        await self._call("add_engines", [e.handle for e in engines], [e.engine_id for e in engines])

    async def retire_engines(self, engine_ids: list[str], timeout_s: float) -> int:
        """Drain engines for good: out of routing, their in-flight requests aborted (the trajectories
        continue on other engines from their tokens so far). Returns the requests aborted."""
        return await self._call(
            "retire_engines", list(engine_ids), timeout_s, timeout_s=timeout_s + self.timeouts.query_s
        )

    async def pause(self, epoch: int | None = None) -> None:
        """Park the worker's loops (weight_sync's `PausableWorkers`; `epoch` fences a late pause)."""
        await self._call("pause", epoch=epoch, timeout_s=self.timeouts.stop_s)

    async def resume(self, epoch: int | None = None) -> None:
        await self._call("resume", epoch=epoch, timeout_s=self.timeouts.stop_s)

    async def metrics(self) -> dict[str, float]:
        return await self._call("metrics", timeout_s=self.timeouts.query_s)

    async def outcomes(self) -> RolloutOutcomes:
        """Finished and failed trajectories so far, failures by reason (the failed-trajectory check)."""
        return await self._call("outcomes", timeout_s=self.timeouts.probe_s)

    async def shutdown(self) -> None:
        await self._call("shutdown", timeout_s=self.timeouts.stop_s)


__all__ = ["ActorClient", "BufferClient", "LearnerClient", "WorkerClient"]
