"""`gather_within`: gather with a deadline that never leaves an unread exception behind."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from streamrl.core.aio import gather_within


async def _value(v, delay_s=0.0):
    await asyncio.sleep(delay_s)
    return v


async def test_results_in_order_and_errors_as_asked():
    assert await gather_within([_value(1, 0.02), _value(2)], 5.0) == [1, 2]

    async def boom():
        raise ValueError("engine gone")

    with pytest.raises(ValueError, match="engine gone"):
        await gather_within([boom(), _value(2)], 5.0)
    outcomes = await gather_within([boom(), _value(2)], 5.0, return_exceptions=True)
    assert isinstance(outcomes[0], ValueError) and outcomes[1] == 2


async def test_the_deadline_raises_and_cancels_what_is_still_running():
    started = asyncio.Event()

    async def hang():
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(hang())
    with pytest.raises(TimeoutError):
        await gather_within([task, _value(1)], 0.2)
    assert started.is_set() and task.cancelled()


async def test_a_caller_cancelled_while_it_waits_leaves_no_unread_exception(caplog):
    """The weight-sync RPCs and learner calls wait this way: a sync abandoned by its caller (a shutdown,
    the caller's own timeout) must not end in asyncio's "exception was never retrieved" error."""
    hung = asyncio.ensure_future(asyncio.sleep(3600))
    caller = asyncio.ensure_future(gather_within([hung], 3600))
    await asyncio.sleep(0.05)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        caller.cancel()
        await asyncio.wait({caller})  # not `await caller`: its traceback would keep the gather alive
        assert caller.cancelled() and hung.cancelled()
        del caller
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
