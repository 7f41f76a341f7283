"""A trace write error never fails the buffer operation it traces: an append whose `appended` events
cannot be written (a full disk) still returns normally with its rows in the buffer, and the tracer
counts the lost writes and warns once (core/trace.py)."""

from __future__ import annotations

import asyncio
import errno
import logging

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.core import trace
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.streaming.actors.buffer import BufferActor
from tests.buffer.helpers import make_traj


@pytest.fixture(autouse=True)
def _fresh_tracer(monkeypatch):
    """Every test starts with this process's tracer unresolved, and leaves it so."""
    monkeypatch.delenv(trace.RUN_DIR_ENV, raising=False)
    monkeypatch.setattr(trace, "_shard", trace._UNSET)
    monkeypatch.setattr(trace, "_num_write_errors", 0, raising=False)


class _FullDisk:
    """The shard's file on a disk with no space left."""

    def write(self, line: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


async def _append_and_sample() -> tuple[list[bool], list[str]]:
    actor = BufferActor(BufferConfig(batch_size=2, group_size=2))
    try:
        accepted = [await actor.append([make_traj(g, i) for i in range(2)]) for g in "ab"]
        sampled = await actor.sample(0, 1)
        return accepted, [] if sampled is None else sampled.trajectory_ids
    finally:
        await actor.close()


def test_an_append_whose_trace_cannot_be_written_returns_normally_with_its_rows(tmp_path, monkeypatch, caplog):
    trace.configure(tmp_path)
    monkeypatch.setattr(trace._current(), "_file", _FullDisk())
    with caplog.at_level(logging.WARNING, logger=trace.__name__):
        accepted, sampled = asyncio.run(_append_and_sample())
        trace.configure(None)  # a last cost counter and the close: both fail, neither raises
    assert accepted == [True, True] and sampled == ["a/0", "a/1"]
    assert trace.num_write_errors() >= 6  # 4 `appended` and 2 `sampled` events, then the close
    warnings = [r.getMessage() for r in caplog.records if r.name == trace.__name__]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]  # once per process


def test_an_actor_whose_trace_cannot_be_created_runs_untraced(tmp_path, monkeypatch):
    """The shard is created at a process's first event, inside the traced call: the run dir's `trace`
    is a file here, so the folder cannot be made."""
    config = {"trace": {"enabled": True}}
    RunDir(tmp_path).write_info(RunInfo(run_name="r", model_path="tiny", mode="async", config=config))
    RunDir(tmp_path).trace.write_text("not a folder")
    monkeypatch.setenv(trace.RUN_DIR_ENV, str(tmp_path))
    accepted, sampled = asyncio.run(_append_and_sample())
    assert accepted == [True, True] and sampled == ["a/0", "a/1"]
    assert not trace.enabled() and trace.num_write_errors() == 1
