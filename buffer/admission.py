"""Admission control and staleness: pure functions on ints and numpy arrays, no I/O.

Lag of a token = learner_version - policy_version of the weights that sampled it. A trajectory's lag
is taken against its *oldest* sampled token (`min_policy_version`): a multi-turn trajectory that was
interrupted and resumed across weight updates carries several versions, and the first turn is the
stalest part of it. Observation tokens (policy_version -1) have no lag.

Admission (AReaL's staleness manager, counted in trajectories): when the learner is at version v and
consumes `batch_size` trajectories per step in FIFO order, the trajectory that starts now is consumed
at the latest at version `(num_accepted + num_running) // batch_size`. Bounding that by
`v + max_staleness` gives

    capacity = (max_staleness + v + 1) * batch_size - (num_accepted + num_running)

A trajectory samples its first token at (or after) the version it starts at, so bounding the start
bounds the min policy_version, however many versions its later turns span. Capacity is rounded down
to whole GRPO groups (the n samples of a prompt start together) and clamped by a concurrency limit.
Trajectories that will never be consumed (DAPO-filtered, dropped, evicted) must not count as
accepted, or capacity leaks.
"""

from __future__ import annotations

import numpy as np

from rollout.types import OBSERVATION_VERSION


def rollout_capacity(
    *,
    learner_version: int,
    max_staleness: int,
    batch_size: int,
    num_running: int,
    num_accepted: int,
    group_size: int = 1,
    max_concurrent: int | None = None,
) -> int:
    """How many new trajectories may start now (a multiple of `group_size`, >= 0).

    num_running: started and not yet finished (generating, in tools, or parked as partial rows).
    num_accepted: finished since the run began and kept for training (consumed or waiting).
    """
    if min(learner_version, max_staleness, num_running, num_accepted) < 0:
        raise ValueError("learner_version, max_staleness, num_running and num_accepted must be >= 0")
    if batch_size <= 0 or group_size <= 0:
        raise ValueError("batch_size and group_size must be > 0")
    capacity = (max_staleness + learner_version + 1) * batch_size - (num_accepted + num_running)
    if max_concurrent is not None:
        capacity = min(capacity, max_concurrent - num_running)
    return max(0, capacity // group_size * group_size)


def token_lag(learner_version: int, policy_versions: np.ndarray) -> np.ndarray:
    """Per-token lag, same shape as `policy_versions`; -1 where the token was not sampled (version -1)."""
    pv = np.asarray(policy_versions)
    return np.where(pv >= 0, learner_version - pv, OBSERVATION_VERSION).astype(np.int64)


def trajectory_lag(learner_version: int, min_policy_version: int | np.ndarray) -> int | np.ndarray:
    """Lag of whole trajectories from their oldest sampled token; 0 for rows without sampled tokens."""
    mpv = np.asarray(min_policy_version)
    lag = np.where(mpv >= 0, learner_version - mpv, 0)
    return int(lag) if lag.ndim == 0 else lag


def within_staleness(
    *, learner_version: int, min_policy_version: int | np.ndarray, max_staleness: int
) -> bool | np.ndarray:
    """True where a trajectory may still be consumed: lag(oldest sampled token) <= max_staleness."""
    ok = np.asarray(trajectory_lag(learner_version, min_policy_version)) <= max_staleness
    return bool(ok) if ok.ndim == 0 else ok


def lag_histogram(lags: np.ndarray, max_lag: int) -> np.ndarray:
    """Counts of lags 0..max_lag with a final overflow bin (> max_lag); negative lags (observation
    tokens, -1) are ignored. Shape [max_lag + 2]."""
    lags = np.asarray(lags)
    lags = lags[lags >= 0]
    return np.bincount(np.minimum(lags, max_lag + 1), minlength=max_lag + 2)[: max_lag + 2]
