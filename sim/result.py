"""What a simulated run reports, computed the way bench/async_vs_sync.py computes it from a real run's
metrics: over the steady state from the first learner step's line to the last one (engine start-up and
the first batch excluded), and the lag histogram of every trajectory trained (`core.versions`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.core.versions import lag_fractions, lag_histogram

if TYPE_CHECKING:
    from streamrl.sim.pipeline import SimConfig


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One learner step's line: when it was logged, the step, engine busy seconds (mean over
    engines) and the learner's idle seconds so far."""

    t: float
    learner_step: int
    engine_busy_s: float
    learner_idle_s: float


@dataclass(frozen=True, slots=True)
class SimResult:
    trained_samples_per_hour: float
    engine_busy_fraction: float
    learner_idle_fraction: float  # share of the steady state the learner waited for a batch
    lag_mean: float
    lag_hist: dict[str, float]  # `staleness/lag_frac/trajectories/<k>` as the metrics log it
    sync_pause_share: float  # share of the run the engines were paused for weight syncs
    step_s: float  # mean wall seconds per learner step in the steady state
    steps: int
    sim_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    cfg: SimConfig, records: list[StepRecord], lags: list[int], *, paused_s: float, end_s: float
) -> SimResult:
    """The steady-state window starts at step `cfg.warmup_steps` (0: the first step's line, as the bench)."""
    first, last = records[min(cfg.warmup_steps, len(records) - 2)], records[-1]
    span = max(last.t - first.t, 1e-9)
    steps = last.learner_step - first.learner_step
    hist = lag_histogram(np.asarray(lags, dtype=np.int64), cfg.buffer.max_staleness)
    return SimResult(
        trained_samples_per_hour=steps * cfg.buffer.batch_size / span * 3600,
        engine_busy_fraction=(last.engine_busy_s - first.engine_busy_s) / span,
        learner_idle_fraction=(last.learner_idle_s - first.learner_idle_s) / span,
        lag_mean=float(np.mean(lags)) if lags else 0.0,
        lag_hist=lag_fractions(hist, "staleness/lag_frac/trajectories/"),
        sync_pause_share=paused_s / max(end_s, 1e-9),
        step_s=span / max(steps, 1),
        steps=last.learner_step,
        sim_s=end_s,
    )
