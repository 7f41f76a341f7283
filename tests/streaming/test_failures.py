"""A run whose trajectories all fail stops with the reason and a non-zero exit status; it never walks
through every epoch of prompts at learner step 0 and exits 0 as if it had trained.

The window arithmetic on hand-made counts; the driver's loops on fakes (test_driver_loops.py) whose
workers fail every trajectory; the worker's bounded error record; `train_main`'s exit status when
nothing was trained."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.rollout.types import RolloutOutcomes
from streamrl.streaming.driver import run_async, run_sync
from streamrl.streaming.failures import FailureWindow, TooManyFailedTrajectories, too_many_failed
from tests.streaming.test_driver_loops import TIMEOUT_S, _pipeline

REASON = "ValueError: prompt of N tokens exceeds agent.prompt_length=N"


def _outcomes(worker_id: str, finished: int, failed: int, reasons: dict[str, int] | None = None) -> RolloutOutcomes:
    return RolloutOutcomes(
        worker_id=worker_id,
        num_finished=finished,
        num_failed=failed,
        failure_reasons=reasons if reasons is not None else ({REASON: failed} if failed else {}),
    )


def test_too_many_failed_needs_a_full_window_and_more_than_the_share():
    assert not too_many_failed(0, 63, window=64, max_fraction=0.9)  # not a window yet
    assert too_many_failed(0, 64, window=64, max_fraction=0.9)
    assert not too_many_failed(7, 57, window=64, max_fraction=0.9)  # 57/64 = 0.89
    assert too_many_failed(6, 58, window=64, max_fraction=0.9)  # 0.906
    assert not too_many_failed(0, 1000, window=64, max_fraction=1.0)  # 1 = never


def test_the_window_slides_over_the_newest_trajectories_of_every_worker():
    window = FailureWindow(window=10, max_fraction=0.5)
    window.observe(_outcomes("w0", 8, 0))
    window.observe(_outcomes("w1", 0, 4))
    assert (window.num_finished, window.num_failed) == (8, 4) and not window.tripped  # 4/12
    window.observe(_outcomes("w1", 0, 9))  # cumulative: 5 more failures
    assert (window.num_finished, window.num_failed) == (8, 9)  # without the 8 successes: 9 < 10, kept
    assert window.tripped  # 9/17
    window.observe(_outcomes("w0", 9, 0))
    assert (window.num_finished, window.num_failed) == (1, 9) and window.tripped  # the 8 slid out
    window.observe(_outcomes("w0", 9, 0))  # nothing new: unchanged
    window.observe(_outcomes("w0-replacement", 6, 0))  # a new worker counts from zero
    assert (window.num_finished, window.num_failed) == (7, 5) and not window.tripped  # the first 4 slid out
    assert window.reasons() == {REASON: 9}


async def _run_failing(pipeline, mode: str) -> TooManyFailedTrajectories:
    for worker in pipeline.workers:
        worker.fail_with = REASON
    with pytest.raises(Exception) as info:
        try:
            await asyncio.wait_for(run_async(pipeline) if mode == "async" else run_sync(pipeline), TIMEOUT_S)
        finally:
            pipeline.metrics.close()
    error = info.value if isinstance(info.value, TooManyFailedTrajectories) else info.value.__cause__
    assert isinstance(error, TooManyFailedTrajectories), info.value
    assert REASON in str(error) and "trainer.max_failed_fraction=0.9" in str(error)
    assert pipeline.state.learner_step == 0
    return error


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_a_run_whose_every_trajectory_fails_stops_naming_the_reason(tmp_path, mode):
    """Without the check the fake run admits every prompt (failed rows count as progress, dropped
    groups free room) and ends "cleanly" at learner step 0; with it, it stops after a window."""
    pipeline, _, _ = _pipeline(tmp_path, f"trainer.mode={mode}", "trainer.failed_window=16", "data.num_prompts=2000")
    await _run_failing(pipeline, mode)
    assert pipeline.state.cursor < len(pipeline.stream.records)  # stopped before the prompts ran out


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_prompts_used_up_by_failures_stop_the_run_with_the_reason(tmp_path, mode):
    """Fewer trajectories than a window (4 prompts x 2): when the prompts run out, what was counted decides."""
    pipeline, _, _ = _pipeline(tmp_path, f"trainer.mode={mode}", "data.num_prompts=4")
    await _run_failing(pipeline, mode)
    assert pipeline.state.cursor == len(pipeline.stream.records)


@pytest.mark.timeout(TIMEOUT_S)
async def test_some_failures_do_not_stop_a_run(tmp_path):
    pipeline, buffer, learner = _pipeline(tmp_path, "trainer.failed_window=16", "trainer.total_steps=6")
    pipeline.workers[0].fail_with = REASON  # half the trajectories fail: the groups of worker-1 still train
    try:
        await asyncio.wait_for(run_async(pipeline), TIMEOUT_S)
    finally:
        pipeline.metrics.close()
    assert pipeline.state.learner_step == 6 and pipeline.workers[0].num_failed > 0


def test_the_worker_keeps_a_bounded_error_record_and_counts_reasons():
    from streamrl.rollout.worker import MAX_KEPT_ERRORS, MAX_REASONS, RolloutWorker, failure_reason

    worker = RolloutWorker(ctx=None, sink=None)  # only the error bookkeeping is exercised
    for i in range(MAX_KEPT_ERRORS + 100):
        worker._record_error(f"t{i}", ValueError(f"prompt of {500 + i} tokens exceeds agent.prompt_length=512"))
    for i in range(MAX_REASONS + 5):
        worker._record_error(f"u{i}", KeyError(f"reason-{'x' * i}"))
    assert len(worker.errors) == MAX_KEPT_ERRORS and worker.num_errors == MAX_KEPT_ERRORS + 100 + MAX_REASONS + 5
    assert worker.failure_reasons[REASON] == MAX_KEPT_ERRORS + 100
    assert len(worker.failure_reasons) == MAX_REASONS + 1 and worker.failure_reasons["other"] == 6
    assert failure_reason(RuntimeError("")) == "RuntimeError"


def test_a_run_that_trained_nothing_exits_non_zero(tmp_path, monkeypatch, capsys):
    """`train_main` after a run that ended at learner step 0 (the prompts ran out, nothing failed
    loudly): the report is still written, and the exit status says it failed."""
    from streamrl.observability import report
    from streamrl.streaming import train
    from streamrl.streaming.driver_state import DriverState

    async def trained_nothing(cfg, run_dir, state):
        return DriverState()

    monkeypatch.setattr(train, "_init_ray", lambda cfg, run_dir: None)
    monkeypatch.setattr(train, "_train", trained_nothing)
    monkeypatch.setattr(report, "write_report", lambda run_dir: run_dir / "report.html")
    overrides = [f"trainer.run_root={tmp_path}", "trainer.run_name=r"]
    assert train.train_main(config="configs/tiny.toml", overrides=overrides, resume=None) == 1
    assert "the run ended at learner step 0 of" in capsys.readouterr().err
