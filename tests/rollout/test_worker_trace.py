"""The rollout worker's and the agent loop's lifecycle-trace events, on a real worker and agent loop
over the scripted engine: a trajectory paused mid-generation shows queued, an aborted generate,
parked, resumed, then the rest of its turns and its tool call, in that order."""

from __future__ import annotations

import json

import pytest

from streamrl.core import trace
from streamrl.engines.fake import FakeEngine
from streamrl.rollout.types import TrajectoryStatus
from streamrl.rollout.worker import RolloutWorker
from tests.rollout.test_agent_loop import ANSWER, CALL, make_ctx, new_data, turn_script
from tests.rollout.test_worker_invariants import _until


@pytest.fixture
def traced(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "_shard", trace._UNSET)
    trace.configure(tmp_path)
    return tmp_path


def _events(run_dir) -> list[dict]:
    lines = [json.loads(line) for f in (run_dir / "trace").glob("*.jsonl") for line in f.read_text().splitlines()]
    return sorted(lines, key=lambda e: (e["ts"], e["ph"] != "i"))


async def _paused_mid_generation(tiny_tokenizer) -> tuple[RolloutWorker, list]:
    """A real worker whose one trajectory (a tool call, then an answer) is paused mid-generation."""
    script, _ = turn_script(tiny_tokenizer, [CALL, ANSWER])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script, token_delay_s=0.01))
    rows = []

    async def sink(traj):
        rows.append(traj)

    worker = RolloutWorker(ctx, sink, worker_id="worker-7")
    worker.submit(new_data())
    await _until(lambda: ctx.num_in_engine > 0)
    await worker.pause(timeout_s=10)
    return worker, rows


async def test_a_parked_trajectory_is_traced_generate_park_resume(traced, tiny_tokenizer):
    worker, rows = await _paused_mid_generation(tiny_tokenizer)
    await worker.resume()
    await _until(lambda: any(t.status is TrajectoryStatus.FINISHED for t in rows))
    events = [e for e in _events(traced) if e["tid"] == "g0/0"]
    names = [e["name"] for e in events]
    assert names[:4] == ["queued", "generate", "parked", "resumed"], names
    assert events[1]["args"]["aborted"] is True and events[1]["args"]["engine"]
    assert names[4:].count("generate") == 2 and "tool" in names[4:] and "queued" in names[4:]  # relaunched
    assert events[2]["args"]["worker"] == "worker-7"
    generated = sum(e["args"]["tokens"] for e in events if e["name"] == "generate")
    assert generated == sum(rows[-1].response_mask)  # every sampled token is in some generate span


async def test_a_trajectory_still_parked_at_shutdown_gets_its_parked_span_then(traced, tiny_tokenizer):
    worker, rows = await _paused_mid_generation(tiny_tokenizer)
    assert [e["name"] for e in _events(traced) if e["tid"] == "g0/0"] == ["queued", "generate"]  # not yet
    await worker.shutdown()  # the run ends with the trajectory parked: no resume comes
    events = [e for e in _events(traced) if e["tid"] == "g0/0"]
    assert [e["name"] for e in events] == ["queued", "generate", "parked"]
    assert events[2]["args"] == {"worker": "worker-7", "ended": "shutdown"}
    assert rows[-1].status is TrajectoryStatus.PARTIAL  # its partial row is what a resumed run continues
