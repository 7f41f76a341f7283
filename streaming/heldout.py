"""Held-out evaluation: the served policy's reward on prompts it never trains on, before the first
learner step and after the last (verl's `val_before_train` and its final validation).

A training step's mean reward is one prompt x `group_size` samples of the training stream: a noisy
per-step signal. The held-out reward is `data.eval_num_prompts` prompts kept apart from the training
stream (`data.eval_source`, or for a generated source a draw with another seed, minus any prompt the
training stream also holds), each decoded once at `data.eval_temperature` (0 = greedy: fixed weights
give a fixed answer), through the same engines and agent loop (tools, parser, interactions, reward)
as training. It runs in the driver while nothing else generates (before the loops start, after the
workers are parked), so every token comes from one policy version. Its rows never reach the buffer.
Logged as `eval/*` at the learner step it follows; a resumed run does not evaluate its start again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from streamrl.rollout.types import PromptRecord, Trajectory, TrajectoryStatus

if TYPE_CHECKING:
    from streamrl.streaming.config import StreamRLConfig
    from streamrl.streaming.system import System

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003  # a generated source's held-out draw: data.seed + this
EVAL_GROUP_PREFIX = "eval/"  # group ids of held-out trajectories (never in the training stream)


def heldout_records(cfg: StreamRLConfig, training: list[PromptRecord]) -> list[PromptRecord]:
    """The held-out prompts: `eval_num_prompts` of `eval_source` (or a draw of the generated training
    source with another seed) that the training stream does not hold, group ids prefixed `eval/`."""
    from streamrl.rollout.data import messages_hash
    from streamrl.streaming.prompts import load_records

    data = cfg.data
    n = data.eval_num_prompts
    if data.eval_source is not None:
        candidates = load_records(data.eval_source, n, data.seed, data.difficulty)
    else:  # validated: only generated sources have no eval_source
        candidates = load_records(data.source, 2 * n, data.seed + EVAL_SEED_OFFSET, data.difficulty)
    seen = {messages_hash(r.messages) for r in training}
    records = [r for r in candidates if messages_hash(r.messages) not in seen][:n]
    if len(records) < n:
        raise ValueError(
            f"data.eval_num_prompts={n} but only {len(records)} held-out prompts are not also training prompts "
            f"({data.eval_source or data.source}); lower it or give data.eval_source more prompts"
        )
    return [dataclasses.replace(r, group_id=EVAL_GROUP_PREFIX + r.group_id) for r in records]


def eval_config(cfg: StreamRLConfig) -> StreamRLConfig:
    """The run's config with the agent sampling at `data.eval_temperature`."""
    agent = cfg.rollout.agent
    sampling = agent.sampling.model_copy(update={"temperature": cfg.data.eval_temperature})
    rollout = cfg.rollout.model_copy(update={"agent": agent.model_copy(update={"sampling": sampling})})
    return cfg.model_copy(update={"rollout": rollout})


async def run_heldout(cfg: StreamRLConfig, model_path: str, engines: list[Any], records: list[PromptRecord],
                      *, timeout_s: float) -> list[Trajectory]:
    """One trajectory per record at the eval temperature on `engines` (`InferenceEngine`s), in this
    process; the finished and failed trajectories, in no particular order."""
    from streamrl.streaming.eval import rollouts_on

    return await rollouts_on(engines, eval_config(cfg), model_path, records, group_size=1, timeout_s=timeout_s)


def heldout_metrics(trajectories: list[Trajectory], *, num_prompts: int, seconds: float) -> dict[str, float]:
    """`eval/*`: the mean reward over every held-out prompt (a failed trajectory scores 0)."""
    finished = [t for t in trajectories if t.status is TrajectoryStatus.FINISHED]
    return {
        "eval/reward_mean": sum(t.reward for t in finished) / max(num_prompts, 1),
        "eval/num_prompts": float(num_prompts),
        "eval/num_failed": float(num_prompts - len(finished)),
        "eval/response_length_mean": sum(len(t.response_ids) for t in finished) / max(len(finished), 1),
        "eval/seconds": seconds,
    }


async def evaluate(system: System, records: list[PromptRecord]) -> dict[str, float]:
    """Run the held-out prompts on the system's engines now and log `eval/*` at the current step."""
    from streamrl.rollout.engine.ray_engine import RayEngineClient

    cfg = system.cfg
    engines = [RayEngineClient(e.handle, f"engine-{i}", cfg=cfg.rollout.engine) for i, e in enumerate(system.engines)]
    t0 = time.monotonic()
    trajectories = await run_heldout(cfg, system.model_path, engines, records, timeout_s=cfg.trainer.step_timeout_s)
    metrics = heldout_metrics(trajectories, num_prompts=len(records), seconds=time.monotonic() - t0)
    state = system.state
    system.metrics.log(metrics, learner_step=state.learner_step, policy_version=state.policy_version, progress=False)
    logger.info("held-out reward %.3f on %d prompts at learner step %d (v%d), %.0f s", metrics["eval/reward_mean"],
                len(records), state.learner_step, state.policy_version, metrics["eval/seconds"])
    return metrics
