"""Measured against predicted: a real run's steady-state numbers, computed from its metrics the way
bench/async_vs_sync.py computes them, beside the simulator's for the same configuration.

The compared numbers: trained samples per hour, engine busy share, learner idle share (of the steady
state: the bench's `learner/idle_ratio` also counts engine start-up in its denominator), mean lag and
the lag histogram (every bin's share, in share points). A number is within the bound when
|predicted - measured| <= 10 % of measured; the histogram when no bin is off by more than 0.10.

Each number also carries the noise of the comparison itself, the standard error of measured minus
predicted: one run's spread (the measured repeats' standard deviation, or the simulated chance
spread of one run where that is larger or there is one run only) over the number of measured runs,
with the simulated mean's own standard error. `within_noise` says the miss is at most twice that:
a miss the repeats themselves could make, which a model cannot be asked to close.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from streamrl.sim.costs import Costs
from streamrl.sim.observe import Observations
from streamrl.sim.pipeline import SimConfig, simulate

BOUND = 0.10
SCALARS = ("trained_samples_per_hour", "engine_busy_fraction", "learner_idle_fraction", "lag_mean")


def measured(obs: Observations) -> dict[str, Any]:
    """The run's steady state, from its first learner step's line to its last."""
    span = max(obs.elapsed_s[-1] - obs.elapsed_s[0], 1e-9)
    batch = int(obs.config["buffer"]["batch_size"])
    return {
        "trained_samples_per_hour": (obs.step[-1] - obs.step[0]) * batch / span * 3600,
        "engine_busy_fraction": (obs.engine_busy_s[-1] - obs.engine_busy_s[0])
        / max(obs.engine_uptime_s[-1] - obs.engine_uptime_s[0], 1e-9),
        "learner_idle_fraction": (obs.idle_s[-1] - obs.idle_s[0]) / span,
        "lag_mean": obs.lag_mean,
        "lag_hist": obs.lag_hist,
    }


def mean_measured(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several measured runs of one configuration as one: each number's mean, each histogram bin's mean
    share (a bin a run lacks counts 0). Its chance spread is that of one run over sqrt(len(runs))."""
    out: dict[str, Any] = {k: float(np.mean([r[k] for r in runs])) for k in SCALARS}
    bins = sorted({b for r in runs for b in r["lag_hist"]})
    out["lag_hist"] = {b: float(np.mean([r["lag_hist"].get(b, 0.0) for r in runs])) for b in bins}
    return out


def spread_measured(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each number's standard deviation over several measured runs of one configuration (n - 1)."""
    return {k: float(np.std([r[k] for r in runs], ddof=1)) if len(runs) > 1 else 0.0 for k in SCALARS}


def predicted(cfg: SimConfig, costs: Costs, seeds: int = 3) -> dict[str, Any]:
    """The simulator's numbers, averaged over `seeds` seeds, and their spread over the seeds under
    `"sd"`: how much one run of this length varies by chance alone (tool latencies, turns, tokens), the
    noise a single measured run carries too."""
    runs = [simulate(replace(cfg, seed=cfg.seed + s), costs) for s in range(seeds)]
    out: dict[str, Any] = {k: float(np.mean([getattr(r, k) for r in runs])) for k in SCALARS}
    keys = runs[0].lag_hist.keys()
    out["lag_hist"] = {k: float(np.mean([r.lag_hist.get(k, 0.0) for r in runs])) for k in keys}
    out["sync_pause_share"] = float(np.mean([r.sync_pause_share for r in runs]))
    out["seeds"] = seeds
    out["sd"] = {k: float(np.std([getattr(r, k) for r in runs])) for k in SCALARS}
    out["sd"]["lag_hist_max_bin"] = max(
        (float(np.std([r.lag_hist.get(k, 0.0) for r in runs])) for k in keys), default=0.0
    )
    return out


def compare(
    meas: dict[str, Any], pred: dict[str, Any], meas_sd: dict[str, float] | None = None, runs: int = 1
) -> dict[str, Any]:
    """Per number: measured, predicted, relative error, and whether it is within the bound; with
    `pred["sd"]`, also the comparison's noise and whether the miss is within twice it. `meas` is the
    mean of `runs` measured runs whose spread is `meas_sd` (`spread_measured`)."""
    rows: dict[str, Any] = {}
    for k in SCALARS:
        m, p = float(meas[k]), float(pred[k])
        err = (p - m) / abs(m) if m else (0.0 if p == 0 else float("inf"))
        rows[k] = {"measured": m, "predicted": p, "rel_error": err, "within": abs(err) <= BOUND + 1e-12}
        if "sd" in pred:
            one_run = max(pred["sd"][k], (meas_sd or {}).get(k, 0.0))
            noise = float(np.sqrt(one_run**2 / runs + pred["sd"][k] ** 2 / pred.get("seeds", 1)))
            rows[k] |= {"predicted_sd": pred["sd"][k], "noise": noise, "within_noise": abs(p - m) <= 2 * noise}
            if meas_sd is not None:
                rows[k]["measured_sd"] = meas_sd[k]
    bins = sorted(set(meas["lag_hist"]) | set(pred["lag_hist"]))
    diff = max((abs(meas["lag_hist"].get(b, 0.0) - pred["lag_hist"].get(b, 0.0)) for b in bins), default=0.0)
    rows["lag_hist"] = {
        "measured": meas["lag_hist"],
        "predicted": pred["lag_hist"],
        "max_bin_diff": diff,
        "within": diff <= BOUND + 1e-12,
    }
    if "sd" in pred:
        rows["lag_hist"]["predicted_max_bin_sd"] = pred["sd"]["lag_hist_max_bin"]
    return rows
