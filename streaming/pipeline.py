"""Wiring: place engines, rollout workers, the buffer and the learner with Ray, and the operations
the driver loops use (admit, sample, train, publish, checkpoint, replace a preempted worker).

Placement is the same code on one laptop CPU and a multi-node cluster: every part is a Ray actor
with explicit resources (`rollout.engine.num_cpus/num_gpus`, learner resources), so Ray puts engines
and the learner on disjoint devices when they exist.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from streamrl.core import faults, trace
from streamrl.core.atomic import make_dirs
from streamrl.core.run_dir import Accounting, RunDir, write_json
from streamrl.streaming import step_metrics
from streamrl.streaming.checkpoints import (
    CheckpointRecord,
    delete_checkpoints,
    drop_old_checkpoints,
    record_checkpoint,
)
from streamrl.streaming.config import StreamRLConfig
from streamrl.streaming.driver_state import DriverState
from streamrl.streaming.elastic import EngineFleet, admit_joined, check_engines, retire_dead
from streamrl.streaming.errors import check_nonfinite_steps
from streamrl.streaming.failures import check_failures
from streamrl.streaming.prompts import PromptStream, group_id_for, make_group

if TYPE_CHECKING:
    from collections.abc import Callable

    from streamrl.buffer.types import BufferProgress
    from streamrl.observability.metrics import MetricsLogger
    from streamrl.rollout.types import AgentData
    from streamrl.streaming.actors.clients import BufferClient, LearnerClient, WorkerClient
    from streamrl.streaming.actors.engine import RayEngineClient
    from streamrl.streaming.failures import FailureWindow
    from streamrl.streaming.heldout import Evaluator
    from streamrl.streaming.prompt_filter import PromptFilter

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Pipeline:
    cfg: StreamRLConfig
    run_dir: Path
    model_path: str
    engines: list[RayEngineClient]
    workers: list[WorkerClient]
    # the distillation teacher's engines (`[distill]`): routed by every worker, never weight-synced
    teachers: list[RayEngineClient] = field(default_factory=list)
    buffer: BufferClient
    learner: LearnerClient
    stream: PromptStream
    prompt_filter: PromptFilter | None = None  # online difficulty filtering (streaming.prompt_filter); None: off
    metrics: MetricsLogger
    # builds a replacement rollout worker (default: a RolloutWorkerActor, `make_worker`)
    new_worker: Callable[[Pipeline, str], WorkerClient] = field(
        default=lambda pipeline, wid: make_worker(pipeline, wid)
    )
    state: DriverState
    done: bool = False
    exhausted: bool = False  # the run ended early: prompts used up, nothing in flight
    learner_idle_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    num_worker_replacements: int = 0
    elapsed_base_s: float = 0.0  # state.elapsed_s when this segment started
    _last_counters: dict[str, float] = field(default_factory=dict)
    _last_log_elapsed: float = 0.0
    _health_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Admission and orphan resubmission both hand trajectories to workers; one at a time, or a group
    # appended but not yet submitted looks orphaned and is sent to two workers.
    _submit_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _next_worker: int = 0
    num_stranded_checks: int = 0  # consistency checks that found trajectories nobody runs
    dropped_engines: dict[str, str] = field(default_factory=dict)  # out of the weight-sync set (I6)
    evaluator: Evaluator | None = None  # held-out evaluation (streaming.heldout); None = none
    _published: asyncio.Condition = field(default_factory=asyncio.Condition)  # the served version changed
    num_nonfinite_in_row: int = 0  # learner steps skipped for a non-finite loss / gradient, in a row
    failures: FailureWindow | None = None  # failed share of the newest trajectories (streaming.failures)
    fleet: EngineFleet = field(default_factory=EngineFleet)  # engines joining / retired (streaming.elastic)
    checkpoint_in_flight: CheckpointRecord | None = None  # started, not yet sealed and recorded

    # ---- admission ----------------------------------------------------------------------------

    @property
    def groups_per_step(self) -> int:
        return self.cfg.buffer.groups_per_batch

    @property
    def timeout_s(self) -> float:
        return self.cfg.trainer.step_timeout_s

    async def admission_capacity_groups(self) -> int:
        """Whole groups that may start now (AReaL capacity, counted by the buffer: every admitted
        group has rows there from its admission on, so the count survives restarts)."""
        cap = await self.buffer.capacity(
            served_step=self.state.served_step,
            max_concurrent=self.cfg.rollout.max_concurrent_per_worker * len(self.workers),
        )
        return cap // self.cfg.group_size

    async def wait_for_change(self, changes: int, version: int, *, timeout_s: float) -> BufferProgress:
        """Sleep until the buffer's change counter passes `changes` (rows arrived, a batch was sampled:
        in-flight work and readiness moved) or the served version is no longer `version` (a publish
        raised capacity), at most `timeout_s`. Returns the buffer's progress."""
        poll = asyncio.ensure_future(self.buffer.wait_progress(changes, timeout_s))
        published = asyncio.ensure_future(self._wait_published(version))
        try:
            await asyncio.wait({poll, published}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            published.cancel()
        if poll.done():
            return poll.result()
        poll.cancel()  # the remote long-poll ends by itself within `timeout_s`
        return await self.buffer.progress()

    async def _wait_published(self, version: int) -> None:
        async with self._published:
            await self._published.wait_for(lambda: self.state.policy_version != version)

    @property
    def prompts_exhausted(self) -> bool:
        """No prompt is left to admit: the stream ended, or the prompt filter retired every prompt for good."""
        return self.stream.peek() is None or (self.prompt_filter is not None and self.prompt_filter.exhausted)

    async def admit_next_group(self) -> bool:
        """Append the next prompt's group as PENDING rows, durably, then save the cursor, then hand
        the group to a worker. A crash anywhere leaves the cursor at or behind the durable rows, and
        a prompt whose rows are already in the buffer is skipped, not admitted twice (I1). Prompts the
        prompt filter skips are passed first, counted in the state saved with the cursor past them."""
        from streamrl.rollout.types import TrajectoryStatus

        if self.prompt_filter is None:
            item = self.stream.peek()
        else:
            item = await self.prompt_filter.next_prompt(self.stream, self.buffer, self.state)
            if self.state.cursor != self.stream.cursor:  # skips: their count and the cursor in one write
                self.state.cursor = self.stream.cursor
                self.state.save(RunDir(self.run_dir).driver_state)
        if item is None:
            return False
        record, epoch = item
        group = make_group(record, epoch, self.cfg.group_size, self.cfg.rollout.agent.default_interaction)
        async with self._submit_lock:
            already = await self.buffer.has_group(group[0].group_id)
            if not already:
                for d in group:
                    trace.instant("admitted", "trajectory", d.trajectory_id, group_id=d.group_id, epoch=epoch)
                await self.buffer.append_durable([d.to_trajectory(TrajectoryStatus.PARTIAL) for d in group])
                self.state.num_admitted += len(group)
                faults.hit("admit.after_append")
            self.stream.advance()
            self.state.cursor = self.stream.cursor
            self.state.save(RunDir(self.run_dir).driver_state)
            if already:  # admitted before a crash, after the last saved cursor: resumed from the buffer
                return True
            faults.hit("admit.before_submit")
            await self._submit(group)
        return True

    async def reconcile_cursor(self) -> int:
        """On resume: move the cursor past prompts whose rows are durable although the cursor save
        did not happen (a kill between the two). Returns how many were skipped this way."""
        skipped = 0
        while (item := self.stream.peek()) is not None:
            if not await self.buffer.has_group(group_id_for(*item)):
                break
            self.stream.advance()
            skipped += 1
        if skipped:
            self.state.cursor = self.stream.cursor
            self.state.save(RunDir(self.run_dir).driver_state)
        return skipped

    async def _submit(self, items: list[AgentData]) -> None:
        """Hand trajectories to the next live worker (round robin). A dead worker is skipped: its
        rows are durable and `check_workers` resubmits them once it is replaced."""
        for _ in range(len(self.workers)):
            worker = self.workers[self._next_worker % len(self.workers)]
            self._next_worker += 1
            try:
                await worker.submit(items)
                return
            except ray.exceptions.RayActorError:
                logger.warning("rollout worker died while %d trajectories were handed to it", len(items))
        logger.warning("no live rollout worker took %d trajectories; the health loop resubmits them", len(items))

    # ---- learning -----------------------------------------------------------------------------

    async def sample_batch(self) -> ray.ObjectRef | None:
        """The next batch (a reference, opaque here: it goes from the buffer to the learner), or None."""
        return await self.buffer.sample(
            served_version=self.state.policy_version, learner_step=self.state.learner_step + 1
        )

    async def train_step(self, batch_ref: ray.ObjectRef) -> dict[str, float]:
        t0 = time.monotonic()
        with trace.span("train_step", "driver", "driver", learner_step=self.state.learner_step + 1):
            trained = await self.learner.train_step(batch_ref)
        self.state.learner_step += 1
        self.num_nonfinite_in_row = self.num_nonfinite_in_row + 1 if trained.skipped_nonfinite else 0
        check_nonfinite_steps(self.num_nonfinite_in_row, self.cfg.learner.max_nonfinite_steps, self.state.learner_step)
        for trajectory in trained.samples:
            self.metrics.sample(trajectory, self.state.learner_step)
        self.metrics.span("train", "learner", t0 - self.started, time.monotonic() - self.started)
        return trained.metrics

    async def publish_weights(self) -> dict[str, float]:
        t0 = time.monotonic()
        with trace.span("publish", "driver", "driver", learner_step=self.state.learner_step):
            published = await self.learner.publish()
        metrics, self.state.policy_version = dict(published.metrics), published.policy_version
        self.dropped_engines = dict(published.dropped_engines)
        metrics["sync/num_engines_excluded"] = float(len(self.dropped_engines))
        if self.state.policy_version > self.state.version_high_water:
            self.state.version_high_water = self.state.policy_version
            self.state.save(RunDir(self.run_dir).driver_state)
        async with self._published:
            self._published.notify_all()
        self.metrics.span("sync", "engines", t0 - self.started, time.monotonic() - self.started)
        return metrics

    # ---- checkpoint / resume ------------------------------------------------------------------

    async def checkpoint(self) -> None:
        """Checkpoint the current learner step (`streaming.checkpoints`): the learner snapshots its
        state and, with `trainer.async_checkpoint`, writes it in the background while training goes
        on; `settle_checkpoint` records it once sealed. One write at a time: a write still in flight
        is settled first."""
        await self.settle_checkpoint()
        step_dir = RunDir(self.run_dir).checkpoint(self.state.learner_step)
        make_dirs(step_dir.parent, sync=True)  # durable: the saved state will name a folder inside it
        await self.learner.start_checkpoint(str(step_dir))
        self.checkpoint_in_flight = CheckpointRecord.at(self.state, step_dir)
        if not self.cfg.trainer.async_checkpoint:
            await self.settle_checkpoint()

    async def settle_checkpoint(self, *, wait: bool = True) -> Path | None:
        """Record the checkpoint in flight once the learner has sealed it: the buffer made durable,
        the record in the driver state, the state saved, then old checkpoints deleted. With
        `wait=False` a write still running is left for a later call. Returns the recorded folder.
        A failed write raises its `CheckpointWriteError` and records nothing."""
        record = self.checkpoint_in_flight
        if record is None or (not wait and await self.learner.checkpoint_busy()):
            return None
        self.checkpoint_in_flight = None
        await self.learner.finish_checkpoint()
        await self.buffer.checkpoint()
        record_checkpoint(self.state, record)
        dropped = drop_old_checkpoints(self.state, self.cfg.trainer.keep_checkpoints)
        self.state.elapsed_s = self.total_elapsed_s
        self.state.save(RunDir(self.run_dir).driver_state)
        delete_checkpoints(dropped)  # only once the saved state no longer names them
        return Path(record.path)

    @property
    def kept_out(self) -> list[str]:
        """Engines out of routing: dropped by weight sync (I6), or joining (not yet at the served version)."""
        return sorted({*self.dropped_engines, *self.fleet.joining})

    @property
    def serving_engines(self) -> list[RayEngineClient]:
        return [e for e in self.engines if e.engine_id not in self.kept_out]

    @property
    def elapsed_s(self) -> float:
        """Wall time of this process's segment of the run."""
        return time.monotonic() - self.started

    @property
    def total_elapsed_s(self) -> float:
        """Wall time over all segments (earlier ones were killed or finished and resumed)."""
        return self.elapsed_base_s + self.elapsed_s

    # ---- health -------------------------------------------------------------------------------

    async def check_workers(self) -> None:
        """Replace dead rollout workers; resubmit resumable trajectories nobody is running.

        Serialized: the admission and health loops may both notice the same dead worker."""
        async with self._health_lock:
            await retire_dead(self, await self.check_engines())
            await admit_joined(self)
            await self._replace_dead_workers()
            await check_failures(self)

    async def check_engines(self) -> list[RayEngineClient]:
        """I6: the dead engines (`elastic.check_engines`); raises `NoHealthyEngineError` when none is alive."""
        return await check_engines(self.engines)

    async def _replace_dead_workers(self) -> None:
        """Replace dead workers, then resubmit whatever no live worker runs (stranded work: I2)."""
        alive, dead = [], []
        for w in self.workers:
            try:
                await w.num_outstanding()
                alive.append(w)
            except (TimeoutError, ray.exceptions.RayActorError):
                dead.append(w)
                w.kill()  # a worker too slow to answer must not go on as a zombie
        if dead:
            logger.warning("%d rollout worker(s) lost; replacing and resuming their trajectories", len(dead))
            for _ in dead:
                alive.append(self.new_worker(self, f"worker-r{self.num_worker_replacements}"))
                self.num_worker_replacements += 1
            self.workers = alive
            await self.learner.set_workers(self.workers)
        await self.align_routing(alive)
        await self.resubmit_orphans()

    async def align_routing(self, workers: list[WorkerClient]) -> None:
        """Every worker routes to the engines weight sync keeps (I6), not to joining ones, and takes
        back recovered ones."""
        keep_out = self.kept_out
        for w in workers:
            try:
                await w.route(keep_out)
            except (TimeoutError, ray.exceptions.RayActorError):
                continue  # dying: the next check replaces it

    async def resubmit_orphans(self) -> int:
        """Resubmit every resumable trajectory (latest row partial) that no worker runs or holds.

        Serialized with admission (see `_submit_lock`); workers are asked before the buffer, and a
        worker reports a trajectory from submission until its final row is appended, so a
        trajectory in flight is never mistaken for an orphan. A worker dying meanwhile is left to
        the next health check.

        Each resubmission is a new attempt (fencing): the trajectory's partial row is appended again,
        durably, with `attempt` one higher *before* any worker gets it, so the buffer (and a buffer
        recovered from its log) refuses whatever the previous holder still appends late. The workers
        get the rows as the buffer then holds them: a trajectory a late row finished meanwhile is
        not resubmitted (its new-attempt row was refused as late)."""
        async with self._submit_lock:
            running: set[str] = set()
            for w in self.workers:
                try:
                    running.update(await w.running_ids())
                except (TimeoutError, ray.exceptions.RayActorError):
                    return 0  # a worker is dying: the next check replaces it first
            resumable = await self.buffer.resumable_ids()
            missing = [tid for tid in resumable if tid not in running]
            if not missing:
                return 0
            rows = [t.next_attempt() for t in await self.buffer.resumable(missing)]
            if not rows:
                return 0
            try:
                await self.buffer.append_durable(rows)
            except ValueError as exc:  # images whose bytes the log lost (a torn image segment)
                logger.warning("recording the next attempts without their image columns: %s", exc)
                rows = [dataclasses.replace(t, image_refs=[], num_image_tokens=[]) for t in rows]
                await self.buffer.append_durable(rows)  # the worker then fails them, as before
            attempts = {t.trajectory_id: t.attempt for t in rows}
            current = await self.buffer.resumable([t.trajectory_id for t in rows])
            orphans = [t.agent_data() for t in current if t.attempt == attempts[t.trajectory_id]]
            if orphans:
                self.num_stranded_checks += 1
                logger.info(
                    "resubmitting %d trajectories no worker runs (attempts %s)",
                    len(orphans),
                    sorted({d.attempt for d in orphans}),
                )
            for data in orphans:
                await self._submit([data])
            return len(orphans)

    async def write_accounting(self, attempts: int = 3) -> Accounting:
        """I2 at the end of a run: park every worker, then the buffer's resumable trajectories must be
        exactly the ones the workers hold. Writes RUN_DIR/accounting.json (the chaos checker reads it).

        A worker that dies at the very end (a kill mid-tool found one) left durable partial rows that
        nobody holds: it is replaced and its trajectories handed to the replacement first, as the
        health loop would have done, and the accounting retried (`attempts` times at most)."""
        for attempt in range(attempts):
            async with self._health_lock:
                await self._replace_dead_workers()
            held: set[str] = set()
            answered = True
            for w in self.workers:
                try:
                    await w.pause()
                    held.update(await w.running_ids())
                except (TimeoutError, ray.exceptions.RayActorError) as exc:
                    logger.warning("end-of-run accounting (attempt %d): a worker did not answer (%r)", attempt + 1, exc)
                    answered = False
            if answered:
                break
        resumable = set(await self.buffer.resumable_ids())
        # A paused worker still finishes what does not use the engine: a tool call, then the reward
        # call. A trajectory being scored when the workers paused is held, then writes its terminal
        # row and leaves its worker; read in between, it looks held without a partial row. Wait for
        # such trajectories to settle, at most one tool call plus one reward call.
        agent = self.cfg.rollout.agent
        settle_until = time.monotonic() + agent.tool_timeout_s + agent.reward_timeout_s + 1.0
        while held - resumable and time.monotonic() < settle_until:
            await asyncio.sleep(0.2)
            held = await self._held_ids(held)
            resumable = set(await self.buffer.resumable_ids())
        report: Accounting = {
            "learner_step": self.state.learner_step,
            "stranded": sorted(resumable - held),
            "untracked": sorted(held - resumable),
            "resumable": sorted(resumable),
        }
        RunDir(self.run_dir).write_accounting(report)
        if report["stranded"] or report["untracked"]:
            logger.error(
                "I2 violated at the end of the run: %d stranded, %d held without a partial row",
                len(report["stranded"]),
                len(report["untracked"]),
            )
        return report

    async def _held_ids(self, previous: set[str]) -> set[str]:
        """The trajectories the (paused) workers hold now; `previous` if one of them does not answer."""
        held: set[str] = set()
        for w in self.workers:
            try:
                held.update(await w.running_ids())
            except (TimeoutError, ray.exceptions.RayActorError):
                return previous
        return held

    async def write_placement(self) -> dict[str, Any]:
        """RUN_DIR/placement.json: the Ray node of every part, and the cluster's live nodes."""
        placement = {
            "driver": ray.get_runtime_context().get_node_id(),
            "buffer": await self.buffer.node_id(),
            "learner": await self.learner.node_ids(),
            "engines": [await e.node_id() for e in self.engines],
            "rollout_workers": [await w.node_id() for w in self.workers],
            "nodes": {
                n["NodeID"]: {"address": n["NodeManagerAddress"], "resources": n["Resources"]}
                for n in ray.nodes()
                if n["Alive"]
            },
        }
        write_json(RunDir(self.run_dir).placement, placement)
        if len(placement["nodes"]) > 1:
            logger.info(
                "placement over %d nodes: %s",
                len(placement["nodes"]),
                {k: v for k, v in placement.items() if k != "nodes"},
            )
        return placement

    async def shutdown(self) -> None:
        """Orderly end: workers, then the learner, then the buffer (flush + fsync), best effort."""
        steps = [(w.shutdown, "rollout worker") for w in self.workers]
        steps += [(self.learner.shutdown, "learner"), (self.buffer.close, "buffer")]
        for method, what in steps:
            try:
                await method()
            except Exception as exc:  # a part that already died must not hide the run's own outcome
                logger.warning("shutdown of the %s failed: %r", what, exc)

    async def log_step(self, metrics: dict[str, float]) -> None:
        """Gather the parts' numbers and log the step's line (derived values: `step_metrics`)."""
        elapsed = self.elapsed_s
        metrics["learner/idle_ratio"] = self.learner_idle_s / max(elapsed, 1e-9)
        metrics["time/elapsed_s"] = self.total_elapsed_s
        metrics.update(await self.buffer.stats())
        totals = step_metrics.sum_metrics(await self._answers(self.workers, "metrics"))
        metrics.update(step_metrics.worker_increments(totals, self._last_counters))
        self._last_counters = totals
        metrics.update(step_metrics.rollout_interval_metrics(metrics, elapsed - self._last_log_elapsed))
        self._last_log_elapsed = elapsed
        metrics["invariants/stranded_checks"] = float(self.num_stranded_checks)
        if self.prompt_filter is not None:
            metrics.update(self.prompt_filter.metrics(self.state))
        stats = await self._answers(self.engines, "actor_stats", missing=True)
        metrics.update(step_metrics.engine_metrics(stats))
        metrics.update(await self.memory_metrics())
        self.metrics.log(metrics, learner_step=self.state.learner_step, policy_version=self.state.policy_version)

    async def memory_metrics(self) -> dict[str, float]:
        """`memory/<part>_peak_gb` of every part but the learner (which reports its own per step): the
        fullest engine and rollout worker, the buffer, and this driver process (its own RSS peak only:
        a local Ray cluster's processes are its children)."""
        from streamrl.core.memory import peak_rss_gb

        reported = await self._answers([*self.engines, *self.workers, self.buffer], "memory")
        return step_metrics.max_metrics(reported, {"memory/driver_peak_gb": peak_rss_gb()})

    async def _answers(self, actors: list[Any], method: str, *, missing: bool = False) -> list[Any]:
        """`actor.method()` of each actor; one that is gone (the health loop deals with it) is left
        out, or answers None with `missing`."""
        out = []
        for actor in actors:
            try:
                out.append(await getattr(actor, method)())
            except (TimeoutError, ray.exceptions.RayActorError):
                if missing:
                    out.append(None)
        return out


def make_worker(pipeline: Pipeline, worker_id: str) -> WorkerClient:
    """A new RolloutWorkerActor over the pipeline's engines and buffer."""
    from streamrl.streaming.actors.clients import WorkerClient
    from streamrl.streaming.actors.worker import RolloutWorkerActor

    # @ray.remote makes RolloutWorkerActor an ActorClass; pyrefly types the decorated name as the plain class
    handles, ids = [e.handle for e in pipeline.engines], [e.engine_id for e in pipeline.engines]
    teachers = {e.engine_id: e.handle for e in pipeline.teachers}
    handle = RolloutWorkerActor.options(num_cpus=0.25, name=None).remote(  # pyrefly: ignore[missing-attribute]
        worker_id, pipeline.cfg, pipeline.model_path, handles, pipeline.buffer.handle, ids, pipeline.kept_out, teachers
    )
    return WorkerClient(handle, timeout_s=pipeline.timeout_s, timeouts=pipeline.cfg.trainer.actor_timeouts)


__all__ = ["Pipeline", "make_worker"]
