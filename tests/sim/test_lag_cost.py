"""The learning cost of lag (`sim.lag_cost`) and the planner's time to a reward built on it."""

from __future__ import annotations

import json

import pytest

from streamrl.sim.costs import ToolLatency
from streamrl.sim.lag_cost import LagCost, first_crossing, lag_shares, load_lag_cost
from streamrl.sim.plan import plan


def _sweep(tmp_path, curves: dict[tuple[int, str], list[list[float]]]):
    cells = [
        {"lag": lag, "correction": corr, "seed": seed, "per_step": {"eval_reward": curve}}
        for (lag, corr), runs in curves.items()
        for seed, curve in enumerate(runs)
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"settings": {"final_window": 2}, "cells": cells}))
    return path


def test_first_crossing_interpolates_between_steps():
    assert first_crossing([0.0, 0.2, 0.6, 1.0], 0.4) == pytest.approx(1.5)
    assert first_crossing([0.5, 0.6], 0.1) == 0.0
    assert first_crossing([0.0, 0.1], 0.5) is None


def test_steps_to_the_target_per_lag_from_the_seed_mean_curves(tmp_path):
    # lag 0: seeds average to 0, .25, .5, .75, 1, 1 -> final (last 2) 1.0; target 0.9 of the rise: step 3.6
    lag0 = [[0.0, 0.0, 0.5, 0.5, 1.0, 1.0], [0.0, 0.5, 0.5, 1.0, 1.0, 1.0]]
    lag4 = [[0.0, 0.1, 0.2, 0.3, 0.4, 0.5], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]]  # never reaches 0.9
    lag2 = [[0.0, 0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]]
    path = _sweep(tmp_path, {(0, "decoupled"): lag0, (2, "decoupled"): lag2, (4, "decoupled"): lag4})
    cost = load_lag_cost("decoupled", 0.9, path)
    assert cost.target_reward == pytest.approx(0.9)
    assert cost.steps_at_lag[0] == pytest.approx(3.6)
    assert cost.steps_at_lag[2] == pytest.approx(4.6)
    assert cost.steps_at_lag[4] == 6.0 and cost.unreached == {4}  # a floor: the lab's whole length
    assert cost.steps(1) == pytest.approx(4.1)  # linear between measured lags
    assert cost.steps(9) == cost.steps(4) and cost.max_lag == 4
    assert cost.steps_for({0: 1, 2: 1}) == pytest.approx((3.6 + 4.6) / 2)
    with pytest.raises(ValueError, match="no lag-0 runs for correction 'tis'"):
        load_lag_cost("tis", 0.9, path)


def test_the_over_bucket_counts_one_past_the_bound():
    hist = {"staleness/lag_frac/trajectories/0": 0.5, "staleness/lag_frac/trajectories/over": 0.5}
    assert lag_shares(hist, max_staleness=4) == {0.0: 0.5, 5.0: 0.5}


def test_the_recorded_lab_prices_lag_and_the_default_correction_costs_little():
    cost = load_lag_cost()  # bench/results/staleness_sweep.json
    assert set(cost.steps_at_lag) == {0, 1, 2, 4, 8}
    assert cost.steps(0) < cost.steps(8) < 1.5 * cost.steps(0)
    assert load_lag_cost("none").steps(2) > 1.4 * cost.steps(2)  # uncorrected lag costs far more


def test_the_planners_time_to_reward_is_throughput_times_the_cost_of_lag():
    tool = ToolLatency(2.0, 60.0, 120.0)
    free = LagCost("synthetic", 0.9, 1.0, {0: 10.0, 8: 10.0}, source="test")
    dear = LagCost("synthetic", 0.9, 1.0, {0: 10.0, 1: 20.0, 8: 20.0}, source="test")
    kw = dict(steps=6, shares=(0.25, 0.5), batch=64)
    cheap, costly = plan("7B", 32, tool, lag_cost=free, **kw), plan("7B", 32, tool, lag_cost=dear, **kw)
    ttr = cheap["time_to_reward"]
    assert ttr["async_over_sync"] == pytest.approx(cheap["async_over_sync"], rel=1e-9)  # lag is free: throughput
    assert ttr["async"]["seconds"] == pytest.approx(10.0 * cheap["recommended"]["step_s"])
    best = ttr["sync_best_placement"]
    assert ttr["speedup"] == pytest.approx(ttr[best]["seconds"] / ttr["async"]["seconds"])
    # every async trajectory here lags >= 1 once the run is going: priced at up to twice the steps
    lagged = 1 - costly["recommended"]["lag_hist"]["staleness/lag_frac/trajectories/0"]
    want = cheap["time_to_reward"]["async_over_sync"] / (1 + lagged)
    assert costly["time_to_reward"]["async_over_sync"] == pytest.approx(want, rel=1e-6)
