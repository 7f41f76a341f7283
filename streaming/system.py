"""Wiring: place engines, rollout workers, the buffer and the learner with Ray, and the operations
the driver loops use (admit, sample, train, publish, checkpoint, replace a preempted worker).

Placement is the same code on one laptop CPU and a multi-node cluster: every part is a Ray actor
with explicit resources (`rollout.engine.num_cpus/num_gpus`, learner resources), so Ray puts engines
and the learner on disjoint devices when they exist.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from streaming.config import StreamRLConfig
from streaming.prompts import PromptStream, group_id_for, load_records, make_group

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DriverState:
    """The driver's part of a whole-system checkpoint (JSON, written atomically)."""

    learner_step: int = 0
    policy_version: int = 0  # version the engines serve
    cursor: int = 0  # prompts admitted (saved at every admission)
    num_admitted: int = 0  # trajectories admitted
    checkpoint: str | None = None  # directory of the latest complete checkpoint
    checkpoint_step: int = 0  # learner_step / policy_version of that checkpoint: a resume restarts there
    checkpoint_policy_version: int = 0
    elapsed_s: float = 0.0  # wall time of earlier segments of this run

    def rewind_to_checkpoint(self) -> None:
        """On resume: the learner restarts from its checkpoint; the cursor stays (data is in the buffer)."""
        self.learner_step = self.checkpoint_step
        self.policy_version = self.checkpoint_policy_version

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> DriverState:
        return cls(**json.loads(path.read_text()))


@dataclass(kw_only=True)
class System:
    cfg: StreamRLConfig
    run_dir: Path
    model_path: str
    engines: list[Any]
    workers: list[Any]
    buffer: Any
    learner: Any
    stream: PromptStream
    metrics: Any  # streaming.metrics.MetricsLogger
    state: DriverState
    done: bool = False
    learner_idle_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    num_worker_replacements: int = 0
    elapsed_base_s: float = 0.0  # state.elapsed_s when this segment started
    _last_counters: dict[str, float] = field(default_factory=dict)
    _health_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _next_worker: int = 0

    # ---- admission ----------------------------------------------------------------------------

    @property
    def groups_per_step(self) -> int:
        return self.cfg.buffer.groups_per_batch

    @property
    def timeout_s(self) -> float:
        return self.cfg.trainer.step_timeout_s

    async def _call(self, ref: Any, timeout_s: float | None = None) -> Any:
        return await asyncio.wait_for(ref, timeout_s or self.timeout_s)

    async def admission_capacity_groups(self) -> int:
        """Whole groups that may start now (AReaL capacity; running = the buffer's partial rows,
        which include the PENDING rows written at admission, so it survives restarts)."""
        stats = await self._call(self.buffer.stats.remote())
        cap = await self._call(
            self.buffer.capacity.remote(
                learner_version=self.state.policy_version,
                num_running=int(stats["buffer/partial_trajectories"]),
                max_concurrent=self.cfg.rollout.max_concurrent_per_worker * len(self.workers),
            )
        )
        return cap // self.cfg.group_size

    async def admit_next_group(self) -> bool:
        """Append the next prompt's group as PENDING rows (durable), then hand it to a worker."""
        from buffer.schema import trajectories_to_batch
        from rollout.agent_loop.base import AgentLoopBase
        from rollout.types import TrajectoryStatus

        item = self.stream.peek()
        if item is None:
            return False
        record, epoch = item
        group = make_group(record, epoch, self.cfg.group_size, self.cfg.rollout.agent.default_interaction)
        (already,) = await self._call(self.buffer.has_groups.remote([group[0].group_id]))
        self.stream.advance()
        self.state.cursor = self.stream.cursor
        if already:  # admitted before a crash, after the last saved cursor: resumed from the buffer
            self.state.save(self.run_dir / "driver_state.json")
            return True
        rows = [AgentLoopBase.to_trajectory(d, TrajectoryStatus.PARTIAL) for d in group]
        await self._call(self.buffer.append.remote(ray.put(trajectories_to_batch(rows))))
        self.state.num_admitted += len(group)
        self.state.save(self.run_dir / "driver_state.json")
        worker = self.workers[self._next_worker % len(self.workers)]
        self._next_worker += 1
        try:
            await self._call(worker.submit.remote([d.to_json() for d in group]))
        except ray.exceptions.RayActorError:
            # The rows are durable: replacing the worker resubmits them with the other orphans.
            logger.warning("worker died while admitting %s", group[0].group_id)
            await self.check_workers()
        return True

    # ---- learning -----------------------------------------------------------------------------

    async def sample_batch(self) -> Any | None:
        ref = self.buffer.sample.remote(learner_version=self.state.policy_version, learner_step=self.state.learner_step + 1)
        batch = await self._call(ref)
        return None if batch is None else ref

    async def train_step(self, batch_ref: Any) -> dict[str, float]:
        t0 = time.monotonic()
        metrics, samples = await self._call(self.learner.train_step.remote(batch_ref))
        self.state.learner_step += 1
        from rollout.types import Trajectory

        for row in samples:
            self.metrics.sample(Trajectory.from_dict(row), self.state.learner_step)
        self.metrics.span("train", "learner", t0 - self.started, time.monotonic() - self.started)
        return metrics

    async def publish_weights(self) -> dict[str, float]:
        t0 = time.monotonic()
        metrics, self.state.policy_version = await self._call(self.learner.publish.remote())
        self.metrics.span("sync", "engines", t0 - self.started, time.monotonic() - self.started)
        return metrics

    # ---- checkpoint / resume ------------------------------------------------------------------

    async def checkpoint(self) -> Path:
        """Learner (HF weights + optimizer state), buffer (fsync), then the driver state pointer."""
        step_dir = self.run_dir / "checkpoints" / f"step_{self.state.learner_step:06d}"
        step_dir.parent.mkdir(parents=True, exist_ok=True)
        await self._call(self.learner.save_checkpoint.remote(str(step_dir)))
        await self._call(self.buffer.checkpoint.remote())
        self.state.checkpoint = str(step_dir)
        self.state.checkpoint_step = self.state.learner_step
        self.state.checkpoint_policy_version = self.state.policy_version
        self.state.elapsed_s = self.total_elapsed_s
        self.state.save(self.run_dir / "driver_state.json")
        return step_dir

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
            await self._replace_dead_workers()

    async def _replace_dead_workers(self) -> None:
        alive, dead = [], []
        for w in self.workers:
            try:
                await self._call(w.num_outstanding.remote(), 30.0)
                alive.append(w)
            except (ray.exceptions.RayActorError, asyncio.TimeoutError):
                dead.append(w)
        if not dead:
            return
        logger.warning("%d rollout worker(s) lost; replacing and resuming their trajectories", len(dead))
        for _ in dead:
            alive.append(make_worker(self, f"worker-r{self.num_worker_replacements}"))
            self.num_worker_replacements += 1
        self.workers = alive
        await self._call(self.learner.set_workers.remote(self.workers))
        await self.resubmit_orphans()

    async def resubmit_orphans(self) -> int:
        running: set[str] = set()
        for w in self.workers:
            running.update(await self._call(w.running_ids.remote()))
        partial = await self._call(self.buffer.resumable.remote())
        orphans = [t.agent_data_json for t in partial if t.trajectory_id not in running]
        for i, text in enumerate(orphans):
            await self._call(self.workers[i % len(self.workers)].submit.remote([text]))
        return len(orphans)

    async def log_step(self, metrics: dict[str, float]) -> None:
        elapsed = self.elapsed_s
        metrics["learner/idle_ratio"] = self.learner_idle_s / max(elapsed, 1e-9)
        metrics["time/elapsed_s"] = self.total_elapsed_s
        metrics.update(await self._call(self.buffer.stats.remote()))
        totals: dict[str, float] = {}
        for w in self.workers:
            try:
                worker_metrics = await self._call(w.metrics.remote(), 60.0)
            except ray.exceptions.RayActorError:
                continue  # preempted; the health loop replaces it
            for key, value in worker_metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        for key, value in totals.items():  # counters are logged as increments since the last step
            if key == "rollout/reward_sum" or (
                key.startswith("rollout/num_") and key not in ("rollout/num_running", "rollout/num_held")
            ):
                metrics[key] = max(value - self._last_counters.get(key, 0.0), 0.0)
            else:
                metrics[key] = value
        self._last_counters = totals
        if metrics.get("rollout/num_finished"):
            # every trajectory finished since the last step, not only the trained batch
            metrics["rollout/finished_reward_mean"] = metrics["rollout/reward_sum"] / metrics["rollout/num_finished"]
        busy = []
        for i, engine in enumerate(self.engines):
            stats = await self._call(engine.stats.remote(), 60.0)
            metrics[f"engine/busy_fraction/engine-{i}"] = stats.busy_fraction
            busy.append((stats.busy_s, stats.uptime_s))
        metrics["engine/busy_s"] = sum(b for b, _ in busy) / len(busy)
        metrics["engine/uptime_s"] = sum(u for _, u in busy) / len(busy)
        metrics["engine/busy_fraction"] = metrics["engine/busy_s"] / max(metrics["engine/uptime_s"], 1e-9)
        self.metrics.log(metrics, learner_step=self.state.learner_step, policy_version=self.state.policy_version)


def make_worker(sys_or_parts: Any, worker_id: str) -> Any:
    from streaming.rollout_actor import RolloutWorkerActor

    cfg = sys_or_parts.cfg
    return RolloutWorkerActor.options(num_cpus=0.25, name=None).remote(
        worker_id, cfg.model_dump_json(), sys_or_parts.model_path, sys_or_parts.engines, sys_or_parts.buffer
    )


def group_of(trajectory_id: str) -> str:
    return trajectory_id.rsplit("/", 1)[0]


__all__ = ["DriverState", "System", "group_id_for", "load_records", "make_worker"]
