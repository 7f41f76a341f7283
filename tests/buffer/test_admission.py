"""Admission and staleness formulas against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.buffer.admission import rollout_capacity
from streamrl.core.versions import lag_fractions, lag_histogram, token_lag, trajectory_lag, within_staleness


def test_capacity_at_start_is_one_batch_per_allowed_version():
    # (0 + 0 + 1) * 8 - 0 = 8
    assert rollout_capacity(served_step=0, max_staleness=0, batch_size=8, num_running=0, num_accepted=0) == 8
    # (2 + 0 + 1) * 8 - (0 + 5) = 19
    assert rollout_capacity(served_step=0, max_staleness=2, batch_size=8, num_running=5, num_accepted=0) == 19


def test_capacity_tracks_learner_progress():
    # learner at v3 consumed 3*16 = 48, 10 more accepted, 20 running: (1 + 3 + 1) * 16 - (58 + 20) = 2
    assert rollout_capacity(served_step=3, max_staleness=1, batch_size=16, num_running=20, num_accepted=58) == 2
    # over-subscribed never goes negative: (0 + 1 + 1) * 4 - (6 + 9) = -7 -> 0
    assert rollout_capacity(served_step=1, max_staleness=0, batch_size=4, num_running=9, num_accepted=6) == 0


def test_capacity_rounds_down_to_whole_groups_and_respects_concurrency():
    # (1 + 2 + 1) * 16 - (40 + 6) = 18 -> groups of 4 -> 16
    assert (
        rollout_capacity(served_step=2, max_staleness=1, batch_size=16, num_running=6, num_accepted=40, group_size=4)
        == 16
    )
    # concurrency: min(18, 12 - 6 = 6) = 6 -> groups of 4 -> 4
    assert (
        rollout_capacity(
            served_step=2,
            max_staleness=1,
            batch_size=16,
            num_running=6,
            num_accepted=40,
            group_size=4,
            max_concurrent=12,
        )
        == 4
    )


def test_capacity_rejects_bad_input():
    with pytest.raises(ValueError):
        rollout_capacity(served_step=-1, max_staleness=0, batch_size=1, num_running=0, num_accepted=0)
    with pytest.raises(ValueError):
        rollout_capacity(served_step=0, max_staleness=0, batch_size=0, num_running=0, num_accepted=0)


def test_token_lag_marks_observation_tokens():
    assert token_lag(5, np.array([5, 3, -1, 0])).tolist() == [0, 2, -1, 5]


def test_multi_turn_trajectory_lag_uses_oldest_sampled_token():
    # turns sampled at versions 2, 3, 4 (resumed across two weight updates); learner at 6
    assert trajectory_lag(6, 2) == 4
    assert within_staleness(served_version=6, min_policy_version=2, max_staleness=4) is True
    assert within_staleness(served_version=6, min_policy_version=2, max_staleness=3) is False
    assert within_staleness(served_version=6, min_policy_version=np.array([2, 5, -1]), max_staleness=3).tolist() == [
        False,
        True,
        True,
    ]


def test_lag_histogram_has_overflow_bin_and_ignores_observations():
    assert lag_histogram(np.array([0, 0, 1, 2, 3, 7, -1]), max_lag=2).tolist() == [2, 1, 1, 2]


def test_lag_fractions_is_the_one_histogram_family():
    hist = lag_histogram(np.array([0, 0, 1, 2, 3, 7, -1]), max_lag=2)
    assert lag_fractions(hist, "staleness/lag_frac/batch/") == {
        "staleness/lag_frac/batch/0": 2 / 6,
        "staleness/lag_frac/batch/1": 1 / 6,
        "staleness/lag_frac/batch/2": 1 / 6,
        "staleness/lag_frac/batch/over": 2 / 6,
    }
    assert set(lag_fractions(lag_histogram(np.array([], dtype=np.int64), max_lag=1), "x/").values()) == {0.0}


@pytest.mark.parametrize("served_step", [0, 3])
@pytest.mark.parametrize("num_accepted", [0, 8, 40])
@pytest.mark.parametrize("num_running", [0, 6, 30])
def test_expected_admission_with_every_group_kept_is_the_bound(served_step, num_accepted, num_running):
    args = dict(served_step=served_step, max_staleness=2, batch_size=8, num_running=num_running, group_size=4)
    bound = rollout_capacity(num_accepted=num_accepted, **args)
    assert rollout_capacity(num_accepted=num_accepted, kept_share=1.0, **args) == bound


def test_expected_admission_widens_the_window_by_the_share_the_filter_keeps():
    # the bound: (2 + 0 + 1) * 4 - 0 = 12 -> 3 groups of 4 in flight at most, whatever the filter drops
    args = dict(served_step=0, max_staleness=2, batch_size=4, num_accepted=0, group_size=4)
    assert rollout_capacity(num_running=12, **args) == 0
    # one group in 4 kept: 12 / 0.25 = 48 trajectories may be in flight, 12 already are
    assert rollout_capacity(num_running=12, kept_share=0.25, **args) == 36
    # still clamped by the engines' concurrency
    assert rollout_capacity(num_running=12, kept_share=0.25, max_concurrent=32, **args) == 20
    # what is already accepted is never discounted: 12 accepted fill the budget whatever the share
    assert rollout_capacity(**{**args, "num_accepted": 12}, num_running=0, kept_share=0.25) == 0


def test_expected_admission_bounds_the_expected_consumption_step():
    # For every state it admits from, the expected trajectories ahead of the last admitted one
    # (accepted + kept_share * in flight) fit within max_staleness + 1 batches of the served step.
    for kept_share in (1.0, 0.5, 0.3, 0.1):
        for served_step in range(4):
            for num_accepted in range(0, 40, 4):
                for num_running in range(0, 40, 4):
                    cap = rollout_capacity(
                        served_step=served_step,
                        max_staleness=1,
                        batch_size=4,
                        num_running=num_running,
                        num_accepted=num_accepted,
                        group_size=4,
                        kept_share=kept_share,
                    )
                    if cap:
                        ahead = num_accepted + kept_share * (num_running + cap)
                        assert ahead <= (1 + served_step + 1) * 4 + 1e-9, (kept_share, served_step, cap)


def test_expected_admission_rejects_a_share_outside_0_1():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="kept_share"):
            rollout_capacity(
                served_step=0, max_staleness=0, batch_size=4, num_running=0, num_accepted=0, kept_share=bad
            )
