"""Which ready groups make the next batch: pure functions on per-group numpy arrays.

A policy orders the candidate groups (FIFO: settle order; uniform: a random permutation;
prioritized: a permutation drawn without replacement with weight `(reward_std + eps) * decay**lag`,
so informative, fresh groups go first). The batch is then the longest prefix of that order that fits:
exactly `max_groups` groups when batching by count, or as many groups as fit in `token_budget`
(and `max_trajectories`) when batching by tokens. A batch is returned only when it is complete:
enough groups, or the next group in order would overflow the budget. A group larger than the whole
budget is a batch of its own: groups are never split (GRPO advantages are per group) nor dropped
(dropping them would bias training towards short trajectories); the budget shapes batches, while the
learner's memory is bounded by its micro-batches (`learner.micro_batch_tokens`), which split it.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter

import numpy as np

from streamrl.buffer.config import BufferConfig, SamplingPolicy
from streamrl.buffer.groups import GroupState
from streamrl.core.versions import trajectory_lag


def group_order(
    policy: SamplingPolicy,
    *,
    reward_std: np.ndarray,
    lags: np.ndarray,
    rng: np.random.Generator,
    priority_eps: float = 0.01,
    lag_decay: float = 0.5,
) -> np.ndarray:
    """Permutation of candidate indices 0..n-1 (candidates are given in FIFO order)."""
    n = len(lags)
    if policy is SamplingPolicy.FIFO or n <= 1:
        return np.arange(n)
    if policy is SamplingPolicy.UNIFORM:
        return rng.permutation(n)
    weights = (np.asarray(reward_std, dtype=np.float64) + priority_eps) * lag_decay ** np.asarray(
        lags, dtype=np.float64
    )
    return rng.choice(n, size=n, replace=False, p=weights / weights.sum())


def select_prefix(
    order: np.ndarray,
    *,
    num_trajectories: np.ndarray,
    num_tokens: np.ndarray,
    max_groups: int,
    max_trajectories: int,
    token_budget: int | None,
) -> np.ndarray | None:
    """Indices (in `order`) of the batch's groups, or None if no complete batch is ready."""
    if token_budget is None:
        return order[:max_groups] if len(order) >= max_groups else None
    cum_tokens = np.cumsum(num_tokens[order])
    cum_trajs = np.cumsum(num_trajectories[order])
    k = min(
        int(np.searchsorted(cum_tokens, token_budget, side="right")),
        int(np.searchsorted(cum_trajs, max_trajectories, side="right")),
    )
    if k == 0:  # the first group alone is over the budget: it goes alone
        return order[:1] if len(order) else None
    full = k < len(order) or cum_trajs[k - 1] == max_trajectories or cum_tokens[k - 1] == token_budget
    return order[:k] if full else None


def choose_groups(
    cfg: BufferConfig, ready: Iterable[GroupState], *, served_version: int, rng: np.random.Generator
) -> list[GroupState] | None:
    """The groups of the next batch among the READY ones (`ReplayBuffer._choose`), or None if no
    complete batch is ready: oldest-started first (settle order among equals, the order admission's
    bound assumes), ordered by `cfg.sampling`, cut by `select_prefix`. Pure, so the simulator
    (`streamrl.sim`) batches exactly as a run does."""
    candidates = sorted(ready, key=attrgetter("min_policy_version"))
    if not candidates:
        return None
    lags = trajectory_lag(served_version, np.array([g.min_policy_version for g in candidates]))
    order = group_order(
        cfg.sampling,
        reward_std=np.array([g.reward_std for g in candidates]),
        lags=lags,
        rng=rng,
        priority_eps=cfg.priority_eps,
        lag_decay=cfg.lag_decay,
    )
    chosen = select_prefix(
        order,
        num_trajectories=np.array([len(g.finished) for g in candidates]),
        num_tokens=np.array([g.num_tokens for g in candidates]),
        max_groups=cfg.groups_per_batch,
        max_trajectories=cfg.batch_size,
        token_budget=cfg.max_batch_tokens,
    )
    return None if chosen is None else [candidates[i] for i in chosen]
