"""The version vocabulary every part shares: a token's policy version, lag, the lag histogram, and the
label rule. Pure functions on ints, numpy arrays (and torch tensors for `token_lag`), no I/O.

A policy version *label* names one set of weights. Labels never repeat across a restart: a resume
restarts the learner at its checkpoint's step but gives those weights a label above every one used
before, so a run's label is its learner step plus an offset (`PolicyVersion`). Lag is measured in
labels: lag of a token = served version - the version of the weights that sampled it; observation
tokens (not sampled by the policy) carry `OBSERVATION_VERSION` and have no lag. A trajectory's lag is
taken against its oldest sampled token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

import numpy as np

OBSERVATION_VERSION = -1  # policy_version of tokens not sampled by the policy (mask 0)


@dataclass(frozen=True, slots=True)
class PolicyVersion:
    """The label of the weights of learner step `step` in a run whose labels are shifted by `offset`
    (0 until a resume relabels: `streaming.driver_state.DriverState.rewind_to_checkpoint`)."""

    step: int
    offset: int = 0

    @property
    def label(self) -> int:
        return self.step + self.offset

    @classmethod
    def of_label(cls, label: int, offset: int) -> PolicyVersion:
        return cls(step=label - offset, offset=offset)


def token_lag(served_version: int, policy_versions: Any) -> Any:
    """Per-token lag, same shape as `policy_versions`; -1 where the token was not sampled (version -1).

    The one definition of token lag: numpy arrays (and lists) give int64 numpy, torch tensors give a
    tensor of their dtype on their device. The buffer uses it at consume time against the served
    version; the learner's loss uses it against its own version (`learner.step_inputs`)."""
    if hasattr(policy_versions, "masked_fill"):  # a torch tensor (this module does not import torch)
        return (served_version - policy_versions).masked_fill(policy_versions < 0, OBSERVATION_VERSION)
    pv = np.asarray(policy_versions)
    return np.where(pv >= 0, served_version - pv, OBSERVATION_VERSION).astype(np.int64)


@overload
def trajectory_lag(served_version: int, min_policy_version: int) -> int: ...
@overload
def trajectory_lag(served_version: int, min_policy_version: np.ndarray) -> np.ndarray: ...
def trajectory_lag(served_version: int, min_policy_version: int | np.ndarray) -> int | np.ndarray:
    """Lag of whole trajectories from their oldest sampled token; 0 for rows without sampled tokens."""
    mpv = np.asarray(min_policy_version)
    lag = np.where(mpv >= 0, served_version - mpv, 0)
    return int(lag) if lag.ndim == 0 else lag


def within_staleness(
    *, served_version: int, min_policy_version: int | np.ndarray, max_staleness: int
) -> bool | np.ndarray:
    """True where a trajectory may still be consumed: lag(oldest sampled token) <= max_staleness."""
    ok = np.asarray(trajectory_lag(served_version, min_policy_version)) <= max_staleness
    return bool(ok) if ok.ndim == 0 else ok


def lag_histogram(lags: np.ndarray, max_lag: int) -> np.ndarray:
    """Counts of lags 0..max_lag with a final overflow bin (> max_lag); negative lags (observation
    tokens, -1) are ignored. Shape [max_lag + 2]."""
    lags = np.asarray(lags)
    lags = lags[lags >= 0]
    return np.bincount(np.minimum(lags, max_lag + 1), minlength=max_lag + 2)[: max_lag + 2]


def lag_fractions(hist: np.ndarray, prefix: str) -> dict[str, float]:
    """A `lag_histogram` as metrics, the one lag-histogram family every part logs:
    `{prefix}<k>` for lags 0..max_lag and `{prefix}over` for the overflow bin; each the bin's share
    of the total (all 0.0 while nothing was counted). E.g. `staleness/lag_frac/batch/1`."""
    total = max(int(np.sum(hist)), 1)
    last = len(hist) - 1
    return {f"{prefix}{'over' if k == last else k}": int(n) / total for k, n in enumerate(np.asarray(hist).tolist())}
