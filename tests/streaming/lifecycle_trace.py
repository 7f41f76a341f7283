"""Checks of a real run's lifecycle trace (used by the end-to-end test, which traces its run): every
part wrote events, every trajectory the buffer records as interrupted parked and resumed in the trace,
the trace's `trained` steps are the buffer's own consumption records, and `streamrl trace`
summarises it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from streamrl.core.trace import COST_EVERY, TRACER
from streamrl.core.trace_segments import segment_of
from streamrl.observability.trace_summary import trajectory_lives
from streamrl.observability.tracing import Trace, read_trace


def _overlaps(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


def parked_across_a_sync(trace: Trace) -> list[str]:
    """Trajectories with an aborted generation, then a `parked` span overlapping a sync's `paused`
    span, then `resumed` and a generation on newer weights, trained at some step."""
    paused = [e for e in trace.events if e["pid"] == "sync" and e["name"] == "paused"]
    by_tid: dict[str, list[dict[str, Any]]] = {}
    for e in trace.events:
        if e["pid"] == "trajectory":
            by_tid.setdefault(str(e["tid"]), []).append(e)
    found = []
    for tid, life in trajectory_lives(trace).items():
        events, names = by_tid[tid], [e["name"] for e in by_tid[tid]]
        if life.trained_step is None or "parked" not in names:
            continue
        k = names.index("parked")
        before = [e for e in events[:k] if e["name"] == "generate"]
        after = [e for e in events[k:] if e["name"] == "generate"]
        if not (before and after and before[-1]["args"].get("aborted") and "resumed" in names[k:]):
            continue
        lo, hi = after[0]["args"].get("min_version"), before[-1]["args"].get("max_version")
        newer = lo is not None and (hi is None or lo > hi)  # hi None: aborted before its first token
        if newer and any(_overlaps(events[k], p) for p in paused):
            found.append(tid)
    return found


def check_lifecycle_trace(run_dir: Path, latest: pd.DataFrame) -> None:
    """`latest`: the buffer's kept rows (`load_frame(...)[is_latest]`) of the finished run."""
    from streamrl.streaming.cli import main

    trace = read_trace(run_dir)
    kinds = {e["pid"] for e in trace.events}
    assert {"driver", "trajectory", "engine", "learner", "sync"} <= kinds, kinds
    assert len(trace.shards) >= 5, trace.shards  # driver, engine, worker, buffer, learner (x2 segments)
    # Every interrupt the buffer's rows record is in the trace: an interrupted trajectory that went on
    # to finish resumed (on its own worker after a `parked` span, or on another after the first one's
    # death), and one still parked when the run ended has its `parked` span, closed at the worker's
    # shutdown. (Whether a sync finds a generation in flight depends on scheduling; when one is found
    # in a trained trajectory, `parked_across_a_sync` names it: aborted, parked over a pause, resumed
    # on newer weights.)
    names: dict[str, set[str]] = {}
    for e in trace.events:
        if e["pid"] == "trajectory":
            names.setdefault(str(e["tid"]), set()).add(e["name"])
    interrupted = latest[latest["num_interrupts"] > 0]
    finished = interrupted[interrupted["status"] == "finished"]["trajectory_id"]
    parked = interrupted[interrupted["status"] != "finished"]["trajectory_id"]
    missing = [t for t in finished if "resumed" not in names.get(str(t), set())]
    missing += [t for t in parked if "parked" not in names.get(str(t), set())]
    assert not missing, f"interrupted in the buffer, not parked or resumed in the trace: {missing}"
    # Joined to the training data: the step each trajectory was last trained at is the buffer's record.
    lives = trajectory_lives(trace)
    consumed = latest[latest["num_consumed"] > 0]
    steps = {tid: lives[tid].trained_step if tid in lives else None for tid in consumed["trajectory_id"]}
    assert steps == dict(zip(consumed["trajectory_id"], consumed["last_consume_step"].astype(int))), steps
    check_cost_counters(trace)
    assert main(["trace", str(run_dir), "--json"]) == 0
    merged = json.loads((run_dir / "trace.json").read_text())
    assert sum(e["ph"] != "M" for e in merged["traceEvents"]) == len(trace.events)


def check_cost_counters(trace: Trace) -> None:
    """Each process's tracer counted its own events: its last cost counter (written at least every
    COST_EVERY events, in the shard named after the process) counts the events before it in that
    shard's segments. A run this long has some: a process writes one at its first event 5 s after the last."""
    shards: dict[str, list[dict[str, Any]]] = {}
    for segment in trace.shards:  # each track's segments in the order they were written
        lines = [json.loads(line) for line in segment.read_text().splitlines() if line.endswith("}")]
        shards.setdefault(segment_of(segment)[0], []).extend(lines)
    checked = 0
    for track, lines in shards.items():
        counters = [e for e in lines if e["pid"] == TRACER]
        recorded = len(lines) - len(counters)
        if recorded < COST_EVERY and not counters:
            continue
        assert counters, f"{track}: {recorded} events and no cost counter"
        counts = [c["args"]["events"] for c in counters]
        if counts != sorted(counts):
            continue  # a pid reused by the resumed run: two processes' shards under one name
        last = counters[-1]["args"]
        assert counters[-1]["tid"] == track, (track, counters[-1]["tid"])
        assert recorded - COST_EVERY < last["events"] <= recorded, (track, recorded, last)
        assert last["cost_us"] > 0, (track, last)
        checked += 1
    assert checked, "no process wrote a cost counter"
