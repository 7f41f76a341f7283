"""LearnerActor: the training engine plus rank 0 of weight sync, in one Ray actor.

The driver hands it buffer batches by object ref (`train_step`), asks it to publish weights
(`publish`, which pauses the rollout workers, moves the weights into every engine, verifies and
resumes), and to checkpoint. On GPU the same actor drives a learner group (FSDP) instead of a single
process; the interface does not change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)


class _RemoteWorkers:
    """Adapts the RolloutWorkerActor handles to weight_sync's `PausableWorkers` protocol."""

    def __init__(self, handles: list, timeout_s: float) -> None:
        self.handles = list(handles)
        self.timeout_s = timeout_s

    async def pause(self) -> None:
        await asyncio.wait_for(asyncio.gather(*[h.pause.remote() for h in self.handles]), self.timeout_s)

    async def resume(self) -> None:
        await asyncio.wait_for(asyncio.gather(*[h.resume.remote() for h in self.handles]), self.timeout_s)


@ray.remote
class LearnerActor:
    def __init__(self, cfg_json: str, init_checkpoint: str | None = None) -> None:
        from learner.engine import TrainingEngine
        from streaming.config import StreamRLConfig

        logging.basicConfig(level=logging.INFO)
        self.cfg = StreamRLConfig.model_validate_json(cfg_json)
        self.engine = TrainingEngine(self.cfg.learner)
        if init_checkpoint is not None:
            self.engine.load_checkpoint(init_checkpoint)
        self.coordinator = None
        self.workers: _RemoteWorkers | None = None
        self.busy_s = 0.0
        self.started = time.monotonic()

    def policy_version(self) -> int:
        return self.engine.policy_version

    def model_path(self) -> str:
        return str(self.engine.model_path)

    def train_step(self, sampled: Any, num_samples: int = 2) -> tuple[dict[str, float], list[dict]]:
        """One optimizer step on a buffer batch; returns metrics and a few trajectories to log."""
        import numpy as np

        from buffer.schema import batch_to_trajectories
        from streaming.metrics import Histogram, summarize

        t0 = time.monotonic()
        padded = sampled.to_padded()
        metrics = self.engine.train_step(padded)
        self.busy_s += time.monotonic() - t0
        metrics["learner/step_s"] = time.monotonic() - t0
        metrics["learner/busy_fraction"] = self.busy_s / max(time.monotonic() - self.started, 1e-9)
        num_tokens = float(np.asarray(padded.seq_lens).sum())
        metrics["learner/tokens_per_s"] = num_tokens / max(metrics["learner/step_s"], 1e-9)
        rewards = np.asarray(padded.rewards, dtype=np.float64)
        metrics["rollout/reward_mean"] = float(rewards.mean())
        metrics["rollout/reward_std"] = float(rewards.std())
        metrics["rollout/response_len_mean"] = float(np.mean(np.asarray(padded.seq_lens) - np.asarray(padded.prompt_lens)))
        lags = np.asarray(sampled.lags)
        metrics.update(summarize(lags, prefix="staleness/lag_"))
        hist = Histogram(max_bucket=max(self.cfg.buffer.max_staleness + 1, 2))
        hist.add(lags)
        metrics.update(hist.to_metrics("staleness/lag_hist/"))
        table = sampled.table
        samples = [t.to_dict() for t in batch_to_trajectories(table.slice(0, min(num_samples, table.num_rows)))]
        return metrics, samples

    async def connect(self, engines: list, workers: list, policy_version: int) -> None:
        """Build the weight-sync coordinator over the engine actors and rollout worker actors."""
        from rollout.engine.ray_engine import RayEngineClient
        from weight_sync.coordinator import WeightSyncCoordinator

        self.workers = _RemoteWorkers(workers, self.cfg.weight_sync.timeouts.pause)
        engine_cfg = self.cfg.rollout.engine
        clients = [
            RayEngineClient(h, f"engine-{i}", cfg=engine_cfg, policy_version=policy_version)
            for i, h in enumerate(engines)
        ]
        self.coordinator = WeightSyncCoordinator(self.cfg.weight_sync, clients, workers=self.workers)

    def set_workers(self, workers: list) -> None:
        """Replace the pausable set after a preempted worker was replaced."""
        self.workers.handles = list(workers)

    async def publish(self) -> tuple[dict[str, float], int]:
        """Move the current weights into every engine (transactional).

        Returns `sync/*` metrics and the policy_version the engines serve afterwards: the new one, or
        the old one if the sync failed (it is retried at the next publish)."""
        assert self.coordinator is not None, "connect() first"
        target = self.engine.policy_version
        if target <= self.coordinator.policy_version:
            return {}, self.coordinator.policy_version
        result = await self.coordinator.sync(self.engine.named_parameters_for_sync(), target)
        if not result.ok:
            logger.error("weight sync to version %d failed: %s", target, result.error)
        return result.metrics(), self.coordinator.policy_version

    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    def save_hf(self, path: str) -> None:
        self.engine.save_hf(path)
