"""What a policy lag costs in learning: how many learner steps a run whose data is `lag` versions old
needs to reach the reward a lag-0 run reaches, measured by the staleness lab.

The lab (`python -m bench.staleness_sweep`, `bench/results/staleness_sweep.json`) trains the real
learner at an exact, fixed lag for each correction, 3 seeds, and evaluates the learner's own weights
after every step. From its seed-mean curves this module reads, per lag, the first step (linearly
interpolated) at which the curve covers `target_frac` of the way from the start to the lag-0 run's
final reward. `steps(lag)` interpolates between the measured lags; a lag past the largest measured
one is priced at the largest (`max_lag` says where the measurements end).

A run's data holds a mix of lags (the simulator's `lag_hist`), so its cost is the mix's mean:
`steps_for(hist) = Σ share(lag) · steps(lag)`, a linear blend. The lab's task is a toy (a tiny model
learning a vocabulary subset), so a planner built on it names that assumption; the learning benchmark
on SmolLM2 (docs/learning.md) is the real-model check.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SWEEP = Path(__file__).resolve().parents[1] / "bench" / "results" / "staleness_sweep.json"


@dataclass(frozen=True, slots=True)
class LagCost:
    correction: str
    target_frac: float
    target_reward: float  # the reward the steps are counted to
    steps_at_lag: dict[int, float]  # measured lag -> steps to the target (seed-mean curve)
    source: str
    unreached: frozenset[int] = frozenset()  # lags whose curve never reached the target: steps is a floor

    @property
    def max_lag(self) -> int:
        return max(self.steps_at_lag)

    def steps(self, lag: float) -> float:
        """Steps to the target at `lag` (linear between measured lags)."""
        if lag < 0:
            raise ValueError(f"a lag is >= 0, got {lag}")
        lags = sorted(self.steps_at_lag)
        if lag >= lags[-1]:
            return self.steps_at_lag[lags[-1]]
        for lo, hi in zip(lags, lags[1:]):
            if lo <= lag <= hi:
                w = (lag - lo) / (hi - lo)
                return (1 - w) * self.steps_at_lag[lo] + w * self.steps_at_lag[hi]
        raise AssertionError("unreachable: lags start at 0")

    def steps_for(self, lag_shares: dict[float, float]) -> float:
        """Steps to the target for data with these lag shares (they are normalised)."""
        total = sum(lag_shares.values())
        if total <= 0:
            raise ValueError("a lag distribution needs a positive total share")
        return sum(share * self.steps(lag) for lag, share in lag_shares.items()) / total


def first_crossing(curve: list[float], target: float) -> float | None:
    """The (fractional) step at which `curve` first reaches `target`, linear between steps."""
    for i, value in enumerate(curve):
        if value >= target:
            if i == 0:
                return 0.0
            prev = curve[i - 1]
            return i - 1 + (target - prev) / (value - prev)
    return None


def load_lag_cost(correction: str = "decoupled", target_frac: float = 0.9, path: Path = SWEEP) -> LagCost:
    """Read the lab's sweep: per lag, steps for `correction` to reach `target_frac` of lag 0's rise."""
    if not 0 < target_frac <= 1:
        raise ValueError(f"target_frac is in (0, 1], got {target_frac}")
    sweep = json.loads(path.read_text())
    window = int(sweep["settings"]["final_window"])
    curves: dict[int, list[list[float]]] = defaultdict(list)
    for cell in sweep["cells"]:
        if cell["correction"] == correction:
            curves[int(cell["lag"])].append(cell["per_step"]["eval_reward"])
    if 0 not in curves:
        known = sorted({c["correction"] for c in sweep["cells"]})
        raise ValueError(f"the staleness lab has no lag-0 runs for correction {correction!r}: one of {known}")
    mean = {lag: [statistics.fmean(v) for v in zip(*runs)] for lag, runs in curves.items()}
    start = mean[0][0]
    final = statistics.fmean(mean[0][-window:])
    target = start + target_frac * (final - start)
    steps, unreached = {}, set()
    for lag, curve in sorted(mean.items()):
        crossing = first_crossing(curve, target)
        if crossing is None:  # never reached within the lab's steps: priced as all of them, a floor
            unreached.add(lag)
        steps[lag] = crossing if crossing is not None else float(len(curve))
    return LagCost(correction, target_frac, target, steps, source=path.name, unreached=frozenset(unreached))


def lag_shares(lag_hist: dict[str, float], max_staleness: int) -> dict[float, float]:
    """The simulator's `staleness/lag_frac/trajectories/<lag|over>` shares as {lag: share}; "over" (past
    the bound) counts as max_staleness + 1."""
    out: dict[float, float] = {}
    for key, share in lag_hist.items():
        tail = key.rsplit("/", 1)[1]
        lag = float(max_staleness + 1) if tail == "over" else float(tail)
        out[lag] = out.get(lag, 0.0) + share
    return out
