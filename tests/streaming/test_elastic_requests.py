"""The driver's side of `streamrl scale` without Ray (fakes): which engines a scale-down drains, and
the requests it refuses (the last serving engine, an unknown engine, a run that cannot launch)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from streamrl.streaming.elastic import EngineFleet, ScaleRequest, _drain_order, apply_request, drain, scale_up


def _pipeline(ids: list[str], joining: set[str]) -> SimpleNamespace:
    return SimpleNamespace(
        engines=[SimpleNamespace(engine_id=i) for i in ids],
        fleet=EngineFleet(joining=joining),
        _health_lock=asyncio.Lock(),
    )


def test_scale_down_drains_joining_engines_first_then_the_newest():
    pipeline = _pipeline(["engine-0", "engine-1", "engine-10", "engine-3"], joining={"engine-3"})
    assert _drain_order(pipeline) == ["engine-3", "engine-10", "engine-1", "engine-0"]


async def test_refused_requests_change_nothing():
    pipeline = _pipeline(["engine-0", "engine-2"], joining={"engine-2"})
    with pytest.raises(ValueError, match="last engine serving"):
        await drain(pipeline, "engine-0", why="preempted")
    with pytest.raises(ValueError, match="no engine 'engine-7'"):
        await drain(pipeline, "engine-7", why="preempted")
    with pytest.raises(ValueError, match="only vllm engines"):  # no engine config: cannot launch
        await scale_up(pipeline, 1)
    await apply_request(pipeline, ScaleRequest(request_id="r", engines=3))  # the launch runs in the background
    (task,) = pipeline.fleet.starting
    await asyncio.gather(task, return_exceptions=True)
    assert isinstance(task.exception(), ValueError) and pipeline.fleet.num_starting == 0
    assert [e.engine_id for e in pipeline.engines] == ["engine-0", "engine-2"]
    assert pipeline.fleet.retired == {} and pipeline.fleet.next_index == 0
