"""Driver-side invariants in milliseconds, on fakes: version labels across restarts (I4) and the
learner's wait for a batch ending cleanly or loudly, never hanging (I6)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from streamrl.streaming.driver import Stalled, wait_for_batch
from streamrl.streaming.driver_state import DriverState


def test_resume_without_newer_labels_keeps_the_checkpoint_label():
    state = DriverState(
        learner_step=5,
        policy_version=4,
        checkpoint="c",
        checkpoint_step=4,
        checkpoint_policy_version=4,
        version_high_water=4,
    )
    state.rewind_to_checkpoint(max_version_seen=4)
    assert (state.learner_step, state.policy_version, state.served_step) == (4, 4, 4)


def test_resume_labels_the_checkpoint_above_every_version_used_before():
    """sync_every=1, checkpoint at step 4, killed at step 7: versions 5..7 were served before the
    kill, so the checkpoint's weights (step 4) must not be called 4 again nor 5..7."""
    state = DriverState(
        learner_step=7,
        policy_version=7,
        checkpoint="c",
        checkpoint_step=4,
        checkpoint_policy_version=4,
        version_high_water=7,
    )
    state.rewind_to_checkpoint(max_version_seen=7)
    assert state.learner_step == 4 and state.policy_version == 8 and state.served_step == 4
    # The next learner step is labelled 9: label = step + offset, never reused.
    assert 5 + state.version_offset == 9
    # A second crash before the next checkpoint: the same checkpoint gets yet another fresh label.
    state.policy_version, state.version_high_water, state.learner_step = 10, 10, 6
    state.rewind_to_checkpoint(max_version_seen=10)
    assert state.policy_version == 11 and state.served_step == 4


def test_a_version_seen_only_in_the_buffer_counts():
    """Killed after an engine served version 3 but before the driver saved it: the buffer knows."""
    state = DriverState(learner_step=2, policy_version=2, checkpoint=None, version_high_water=2)
    state.rewind_to_checkpoint(max_version_seen=3)
    assert state.policy_version == 4 and state.served_step == 0


def _fake_pipeline(*, in_flight: int, rows, exhausted: bool, stall_timeout_s: float = 60.0):
    from streamrl.buffer.types import BufferProgress

    rows = iter(rows)

    async def progress():
        return BufferProgress(in_flight=in_flight, rows_appended=next(rows))

    async def wait_progress(after, timeout_s):
        await asyncio.sleep(0.01)
        return await progress()

    async def no_batch():
        return None

    sys = SimpleNamespace(
        cfg=SimpleNamespace(
            trainer=SimpleNamespace(
                stall_timeout_s=stall_timeout_s, total_steps=10, failed_window=64, max_failed_fraction=0.9
            )
        ),
        state=SimpleNamespace(cursor=7, learner_step=3, policy_version=3),
        buffer=SimpleNamespace(progress=progress, wait_progress=wait_progress),
        sample_batch=no_batch,
        prompts_exhausted=exhausted,
        exhausted=False,
        run_dir=Path("."),
        workers=[],  # no failures to count
        failures=None,
    )
    return sys


async def test_exhausted_prompts_end_the_wait_cleanly():
    sys = _fake_pipeline(in_flight=0, rows=[5] * 10, exhausted=True)
    assert await asyncio.wait_for(wait_for_batch(sys), 5) is None
    assert sys.exhausted


async def test_no_rows_for_the_stall_timeout_is_a_clear_error():
    sys = _fake_pipeline(in_flight=8, rows=[5] * 1000, exhausted=False, stall_timeout_s=0.3)
    with pytest.raises(Stalled, match="8 trajectories in flight"):
        await asyncio.wait_for(wait_for_batch(sys), 10)


async def test_rows_arriving_keep_the_wait_alive():
    sys = _fake_pipeline(in_flight=8, rows=range(1000), exhausted=False, stall_timeout_s=0.3)
    with pytest.raises(asyncio.TimeoutError):  # still waiting, no Stalled: rows keep arriving
        await asyncio.wait_for(wait_for_batch(sys), 1.0)


def _engines_pipeline(*answers):
    """A Pipeline whose engines answer `actor_stats` as given: "ok", "dead" (the actor is gone) or "slow"."""
    import ray

    from streamrl.streaming.pipeline import Pipeline

    def engine(answer):
        async def stats():
            if answer == "dead":
                raise ray.exceptions.RayActorError()
            if answer == "slow":
                raise TimeoutError()
            return SimpleNamespace(busy_fraction=0.5)

        return SimpleNamespace(actor_stats=stats)

    fake = SimpleNamespace(engines=[engine(a) for a in answers])
    return lambda: Pipeline.check_engines(fake)


async def test_no_engine_alive_is_a_clear_error_not_a_livelock():
    """Found by `make chaos` (engine scenario, seed 0): the only engine died before the first sync,
    every trajectory then failed at once, rows kept arriving, and the run cycled through 77 epochs
    of prompts for 10 minutes. The health check now stops it."""
    from streamrl.engines.base import NoHealthyEngineError

    with pytest.raises(NoHealthyEngineError, match="no inference engine is alive: engine-0: RayActorError"):
        await _engines_pipeline("dead")()
    with pytest.raises(NoHealthyEngineError, match="engine-0: .*; engine-1: "):
        await _engines_pipeline("dead", "dead")()
    await _engines_pipeline("dead", "ok")()  # one left: routing and the next sync deal with the dead one
    await _engines_pipeline("slow")()  # slow is not dead
