"""`BufferStats.account_batch`: per-batch lag, version span, interruptions and in-flight / in-queue
times, against hand-built trajectories."""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl.buffer.schema import trajectories_to_batch
from streamrl.buffer.stats import BufferStats
from tests.buffer.helpers import make_traj


def _traj(i: int, versions: list[int], *, interrupts: int, created: float, finished: float):
    t = make_traj("g", i, num_response=len(versions))
    mask = [1] * len(versions)
    return dataclasses.replace(
        t,
        response_mask=mask,
        policy_versions=versions,
        behavior_logprobs=[-0.5] * len(versions),
        num_interrupts=interrupts,
        created_at=created,
        finished_at=finished,
    )


def test_batch_version_span_interrupts_and_times():
    import pyarrow as pa

    rows = [
        _traj(0, [3, 3, 4, 6], interrupts=2, created=100.0, finished=110.0),  # spans 3 versions
        _traj(1, [5, 5, 5], interrupts=0, created=104.0, finished=106.0),  # spans none
    ]
    table = pa.Table.from_batches([trajectories_to_batch(rows)])
    stats = BufferStats(max_staleness=4)
    stats.account_batch(table, np.array([3, 1]), served_version=6, now=120.0)
    got = stats.staleness()
    assert got["staleness/batch_version_span_mean"] == 1.5 and got["staleness/batch_version_span_max"] == 3.0
    assert got["staleness/batch_interrupts_mean"] == 1.0
    assert got["staleness/batch_in_flight_s_mean"] == 6.0  # (10 + 2) / 2
    assert got["staleness/batch_in_queue_s_mean"] == 12.0  # (10 + 14) / 2
    # token lags 3 3 2 0 | 1 1 1 against served version 6
    assert got["staleness/batch_token_lag_max"] == 3.0
    assert np.isclose(got["staleness/batch_token_lag_mean"], 11 / 7)
    assert got["staleness/batch_trajectory_lag_max"] == 3.0
