"""`WeightPublisher`: the learner end of weight sync, in the process that holds the full tensors.

It owns what must outlive one sync: a `WeightSyncCoordinator` over the engines (the clients of
the engine actors it is given; the transport's group is reused while the engine set is unchanged), the
rollout workers (their clients) it pauses and resumes, and the policy_version the engines serve: its
coordinator holds that label, the only copy in the learner's process, and decides whether a target
is new to the engines; the learner actor and a learner group ask here (`served_version`,
`nothing_new`, `unchanged`) and are told in the `Published` record of every publish. It lives
in the single-process `LearnerActor`, or — with an FSDP learner group — in learner rank 0
(`streaming/actors/learner_backends.py`), because the transport's rank 0 must be where the gathered
tensors are. Failure semantics are the coordinator's: a failed sync returns the old version, which
keeps serving, and is retried at the next publish; a dead engine leaves the sync set (named in
the `Published` record's `dropped_engines`, for the driver to take out of routing) and the run goes
on with the others; with no engine left, `publish` raises `NoHealthyEngineError`.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from streamrl.core.aio import gather_within
from streamrl.weight_sync.types import AdapterSpec, Published

if TYPE_CHECKING:
    import torch

    from streamrl.weight_sync.config import WeightSyncConfig
    from streamrl.weight_sync.coordinator import PausableWorkers
    from streamrl.weight_sync.transport import SyncEngine

logger = logging.getLogger(__name__)


class WorkerSet:
    """The rollout workers as one `PausableWorkers`: each worker's client (`streaming.actors.clients.
    WorkerClient`, any object with `pause(epoch)` / `resume(epoch)`) is called concurrently, within
    `timeout_s` in all.

    A preempted (dead) worker is skipped, not an error: it holds no loop to park or resume, its
    engine requests are aborted by the engine pause, and the driver's health loop replaces it and
    resumes its trajectories from the buffer."""

    def __init__(self, workers: Sequence[PausableWorkers], timeout_s: float) -> None:
        self.workers = list(workers)
        self.timeout_s = timeout_s

    async def _each(self, method: str, epoch: int | None) -> None:
        import ray

        calls = [getattr(w, method)(epoch=epoch) for w in self.workers]
        outcomes = await gather_within(calls, self.timeout_s, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, ray.exceptions.RayActorError):
                logger.warning("rollout worker died before %s; the driver replaces it", method)
            elif isinstance(outcome, BaseException):
                raise outcome

    async def pause(self, epoch: int | None = None) -> None:
        await self._each("pause", epoch)

    async def resume(self, epoch: int | None = None) -> None:
        await self._each("resume", epoch)


class LaggedWeights:
    """The last `lag + 1` published versions' tensors (CPU copies): `publish_lag` sends the one `lag`
    versions behind the newest, so the engines always serve exactly that stale a policy."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self._kept: collections.deque[tuple[int, list[tuple[str, torch.Tensor]]]] = collections.deque(maxlen=lag + 1)

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, list] | None:
        """Keep `version`; return (version, tensors) of `version - lag` if it is kept, else None (the
        run is younger than the lag, or it resumed and the window is refilling)."""
        self._kept.append((version, [(name, t.detach().to("cpu", copy=True)) for name, t in named_tensors]))
        oldest_version, tensors = self._kept[0]
        return (oldest_version, tensors) if oldest_version == version - self.lag else None


class WeightPublisher:
    """Publishes named tensors as a policy_version to every engine; see the module docstring."""

    def __init__(
        self, cfg: WeightSyncConfig, clients: Sequence[SyncEngine], workers: Sequence[PausableWorkers]
    ) -> None:
        """`clients`: the engines, as engine clients named `engine-{i}` that know the served version
        (`streaming.actors.engine.engine_clients`); `workers`: the rollout workers' clients it pauses."""
        from streamrl.weight_sync.coordinator import WeightSyncCoordinator

        self.workers = WorkerSet(workers, cfg.timeouts.pause)
        self.coordinator = WeightSyncCoordinator(cfg, clients, workers=self.workers)
        self.lagged = LaggedWeights(cfg.publish_lag) if cfg.publish_lag else None

    @property
    def served_version(self) -> int:
        """The policy_version the engines serve (read-only: a committed sync moves it, in the coordinator)."""
        return self.coordinator.served_version

    @property
    def dropped_engines(self) -> dict[str, str]:
        """engine_id (`engine-{i}`, the rollout workers' names too) -> why it left the sync set."""
        return dict(self.coordinator.dropped)

    def unchanged(self) -> Published:
        """The record of a publish that sends nothing: what is served now, the engines out, no metrics."""
        return Published(policy_version=self.served_version, dropped_engines=self.dropped_engines, metrics={})

    def nothing_new(self, target: int) -> Published | None:
        """`unchanged()` when `target` is nothing new to the engines (`WeightSyncCoordinator.is_new`),
        None when publishing it sends weights. A learner group asks this before its ranks gather."""
        return None if self.coordinator.is_new(target) else self.unchanged()

    def set_workers(self, workers: Sequence[PausableWorkers]) -> None:
        """Replace the pausable set after a preempted rollout worker was replaced."""
        self.workers.workers = list(workers)

    async def add_engines(self, clients: Sequence[SyncEngine]) -> list[str]:
        """New engines join the sync set; the next sync brings them to its version (see coordinator)."""
        return await self.coordinator.add_engines(clients)

    async def remove_engines(self, engine_ids: Sequence[str]) -> list[str]:
        """Drained or dead engines leave the sync set for good."""
        return await self.coordinator.remove_engines(engine_ids)

    async def publish(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], target: int, *, adapter: AdapterSpec | None = None
    ) -> Published:
        """Move `named_tensors` into every engine as `target` (transactional); with `adapter` they are a
        LoRA adapter's A and B, served by the engines as a new adapter (`WeightSyncCoordinator.sync`).

        Returns the policy_version served afterwards (`target`, or the old one if the sync failed),
        the engines out of the sync set and `sync/*` metrics. A `target` not above the served version
        is a no-op. Raises `NoHealthyEngineError` ("no healthy inference engine left: ...") when every
        engine is gone. With `publish_lag` k the weights of `target - k` are sent instead (labelled so),
        none before the run has k older versions."""
        if self.lagged is not None:
            behind = self.lagged.push(target, named_tensors)
            if behind is None:
                return self.unchanged()
            target, named_tensors = behind
        if (same := self.nothing_new(target)) is not None:
            return same
        result = await self.coordinator.sync(named_tensors, target, adapter=adapter)
        if not result.ok:
            logger.error("weight sync to policy_version %d failed: %s", target, result.error)
        if result.dropped_engine_ids:
            logger.error("engines %s left the sync set: %s", result.dropped_engine_ids, self.dropped_engines)
        return Published(
            policy_version=self.served_version, dropped_engines=self.dropped_engines, metrics=self.coordinator.metrics()
        )

    async def close(self) -> None:
        await self.coordinator.close()
