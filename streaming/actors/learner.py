"""LearnerActor: the learner as one Ray actor the driver talks to — training, weight publishing and
checkpoints — whatever runs behind it.

The driver hands it buffer batches by object ref (`train_step`), asks it to publish weights
(`publish`: pause the rollout workers, move the weights into every engine, verify, resume) and to
checkpoint. Behind it (`streaming/actors/learner_backends.py`): with `learner.num_workers = 1` the training
engine and the weight publisher live in this actor's process; with `num_workers > 1` it only
coordinates an FSDP2 `LearnerGroup` of Ray actors whose rank 0 publishes. The interface does not
change. Create it with `LearnerActor.options(**learner_actor_options(cfg))`: the actor reserves the
learner's resources itself in the first case and none in the second (the ranks reserve theirs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from streamrl.core import trace
from streamrl.rollout.types import Trajectory
from streamrl.streaming.config import StreamRLConfig
from streamrl.weight_sync.types import Published

if TYPE_CHECKING:
    from streamrl.buffer.types import SampledBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Trained:
    """One learner step, across the actor boundary: its metrics (observability only), a few of the
    batch's trajectories for the report, and whether the step was skipped for a non-finite loss or
    gradient norm (its weights are unchanged; the driver counts these)."""

    metrics: dict[str, float]
    samples: list[Trajectory]
    skipped_nonfinite: bool = False


def learner_actor_options(cfg: StreamRLConfig) -> dict[str, float]:
    """Ray options of the LearnerActor (needs `ray.init` done when `learner.device = "auto"`).

    One process: the learner's own CPUs/GPU (`learner.num_cpus_per_worker`, `num_gpus_per_worker`).
    A group: nothing — the actor only coordinates; each rank actor asks for its own resources."""
    if cfg.learner.num_workers > 1:
        return {"num_cpus": 0, "num_gpus": 0}
    from streamrl.learner.group import placement

    return placement(cfg.learner).actor_options()


@ray.remote
class LearnerActor:
    def __init__(self, cfg: StreamRLConfig, init_checkpoint: str | None = None) -> None:
        from streamrl.streaming.actors.learner_backends import GroupLearner, LocalLearner

        logging.basicConfig(level=logging.INFO)
        self.cfg = cfg
        if cfg.placement.learner_cores is not None:  # before the model loads and torch starts its pool
            from streamrl.streaming.placement import pin_part

            pin_part(cfg.placement.learner_cores)
        backend = GroupLearner if self.cfg.learner.num_workers > 1 else LocalLearner
        self.learner = backend(self.cfg, init_checkpoint)
        self.busy_s = 0.0
        self.started = time.monotonic()
        # a step changed the weights since the engines got them (what they serve: `Published.policy_version`,
        # held by the weight publisher alone)
        self.weights_changed = False

    def policy_version(self) -> int:
        return self.learner.policy_version

    async def set_policy_version(self, version: int) -> None:
        """Label the current weights `version` (a resume labels them above every version used
        before the crash, so labels never repeat: invariant I4)."""
        await self.learner.set_policy_version(version)

    async def node_ids(self) -> list[str]:
        """The Ray nodes of the training processes: this actor's, or each rank's in a group."""
        return await self.learner.node_ids()

    def model_path(self) -> str:
        return self.learner.model_path

    def pid(self) -> int:
        """This actor's process id (with one learner process, where its threads' placement is read)."""
        import os

        return os.getpid()

    async def train_step(self, sampled: SampledBatch, num_samples: int = 2) -> Trained:
        """One optimizer step on a buffer batch; returns metrics (`learner/*`, `is/*`, `staleness/*` and
        the learner's `memory/learner_peak_gb` / `memory/learner_rss_gb`) and a few trajectories to log."""
        import numpy as np

        from streamrl.buffer.schema import batch_to_trajectories
        from streamrl.core.catalogue import LAG_FRAC
        from streamrl.core.versions import lag_fractions, lag_histogram
        from streamrl.observability.metrics import summarize

        t0 = time.monotonic()
        padded = sampled.to_padded()
        step = sampled.learner_step
        with trace.span("train_step", "learner", "learner", learner_step=step, trajectories=sampled.num_trajectories):
            result = await self.learner.train_step(padded)
        for tid in sampled.trajectory_ids if trace.enabled() else ():
            trace.instant("trained", "trajectory", tid, learner_step=step, skipped=result.skipped_nonfinite)
        self.weights_changed |= not result.skipped_nonfinite
        metrics = dict(result.metrics)
        self.busy_s += time.monotonic() - t0
        metrics["learner/step_s"] = time.monotonic() - t0
        metrics["learner/busy_fraction"] = self.busy_s / max(time.monotonic() - self.started, 1e-9)
        metrics["learner/num_workers"] = float(self.cfg.learner.num_workers)
        rewards = np.asarray(padded.rewards, dtype=np.float64)
        metrics["rollout/reward_mean"] = float(rewards.mean())
        metrics["rollout/reward_std"] = float(rewards.std())
        metrics["rollout/response_len_mean"] = float(
            np.mean(np.asarray(padded.seq_lens) - np.asarray(padded.prompt_lens))
        )
        lags = np.asarray(sampled.lags)
        metrics.update(summarize(lags, prefix="staleness/lag_"))
        metrics.update(lag_fractions(lag_histogram(lags, self.cfg.buffer.max_staleness), f"{LAG_FRAC}batch/"))
        table = sampled.table
        samples = batch_to_trajectories(table.slice(0, min(num_samples, table.num_rows)))
        return Trained(metrics=metrics, samples=samples, skipped_nonfinite=result.skipped_nonfinite)

    async def connect(self, engines: list, workers: list, policy_version: int) -> None:
        """Set up weight sync over the engine actors and rollout worker actors (engines serve `policy_version`).
        Engines that serve another version than the learner's (a LoRA adapter resume starts them on the
        base model, `streaming.train.engine_start`) lack its weights: the next publish sends them."""
        await self.learner.connect(engines, workers, policy_version)
        self.weights_changed = policy_version != self.learner.policy_version

    async def set_workers(self, workers: list) -> None:
        """Replace the pausable set after a preempted worker was replaced."""
        await self.learner.set_workers(workers)

    async def add_engines(self, engines: list, ids: list[str]) -> list[str]:
        """Engines launched during the run join the sync set; the next sync brings them to its version."""
        return await self.learner.add_engines(engines, ids)

    async def remove_engines(self, ids: list[str]) -> list[str]:
        """Drained or dead engines leave the sync set for good."""
        return await self.learner.remove_engines(ids)

    async def publish(self) -> Published:
        """Move the current weights into every engine (transactional).

        Returns the policy_version the engines serve afterwards (the new one, or the old one if the
        sync failed: it is retried at the next publish), the engines out of the sync set and `sync/*`
        metrics. When every step since the engines got their weights was skipped as non-finite, the
        weights are unchanged and nothing is sent; whether a newer label is anything to send is the
        weight publisher's to decide (`WeightPublisher.nothing_new`)."""
        if not self.weights_changed:
            return await self.learner.unchanged()
        with trace.span("publish", "learner", "learner", learner_version=self.learner.policy_version) as s:
            published = await self.learner.publish()
            s.set(policy_version=published.policy_version)
        # a failed sync, or one that sent older weights (weight_sync.publish_lag), leaves newer ones to send
        self.weights_changed = published.policy_version < self.learner.policy_version
        return published

    async def start_checkpoint(self, path: str) -> None:
        """Snapshot the learner's state into the checkpoint at `path`, written in the background."""
        await self.learner.start_checkpoint(path)

    async def finish_checkpoint(self) -> str | None:
        """The checkpoint in flight, once sealed (None if none); raises its write's error."""
        return await self.learner.finish_checkpoint()

    async def checkpoint_busy(self) -> bool:
        return await self.learner.checkpoint_busy()

    async def save_hf(self, path: str) -> None:
        await self.learner.save_hf(path)

    async def shutdown(self) -> None:
        """Close the weight-sync group and, for a group, end the rank actors."""
        await self.learner.shutdown()
