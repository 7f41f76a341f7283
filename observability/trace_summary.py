"""What a lifecycle trace says, in numbers: where the time went (per-phase totals), how busy the
engines and the learner were, what share of the time the weight syncs held generation paused, and
the longest trajectories with their phases. `streamrl trace` prints it; the report's timeline uses
the same reading (`trajectory_lives`).

Engine busy is the engine's `busy` spans (some request in flight) over the window; learner busy its
`train_step` spans; the sync pause share the syncs' `paused` spans (from the pause to the resume).
The tracer's cost is each process's last cost counter (`core.trace`): seconds spent tracing over the
span of its own events. The busiest process's share bounds what tracing can take from a pipeline
whose slowest part is one process (each of streamrl's parts is).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from streamrl.core.trace import TRACER
from streamrl.observability.tracing import Trace

TRAJECTORY = "trajectory"
PHASES = ("queued", "generate", "tool", "interaction", "parked")  # a trajectory's spans, in the order of its life


@dataclass
class TrajectoryLife:
    """One trajectory across its attempts: first event to last, time per phase, what happened."""

    trajectory_id: str
    start_us: int
    end_us: int
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    events: list[str] = field(default_factory=list)  # names in time order
    engines: set[str] = field(default_factory=set)
    versions: set[int] = field(default_factory=set)  # policy versions its tokens were sampled with
    trained_step: int | None = None

    @property
    def seconds(self) -> float:
        return (self.end_us - self.start_us) / 1e6


def _note(life: TrajectoryLife, e: dict[str, Any]) -> None:
    args = e.get("args", {})
    life.start_us = min(life.start_us, e["ts"])
    life.end_us = max(life.end_us, e["ts"] + e.get("dur", 0))
    life.events.append(e["name"])
    if e.get("ph") == "X":
        life.phases[e["name"]] = life.phases.get(e["name"], 0.0) + e.get("dur", 0) / 1e6
    if "engine" in args:
        life.engines.add(str(args["engine"]))
    for key in ("min_version", "max_version"):
        if args.get(key) is not None and int(args[key]) >= 0:  # -1: no token sampled yet
            life.versions.add(int(args[key]))
    if e["name"] == "trained" and args.get("learner_step") is not None:
        life.trained_step = int(args["learner_step"])


def trajectory_lives(trace: Trace) -> dict[str, TrajectoryLife]:
    """Every traced trajectory's life, by id."""
    lives: dict[str, TrajectoryLife] = {}
    for e in trace.events:
        if e["pid"] != TRAJECTORY:
            continue
        tid = str(e["tid"])
        life = lives.setdefault(tid, TrajectoryLife(tid, e["ts"], e["ts"] + e.get("dur", 0)))
        _note(life, e)
    return lives


def _span_seconds(trace: Trace, kind: str, name: str) -> dict[str, float]:
    """Seconds of `name` spans per track of `kind`."""
    out: dict[str, float] = defaultdict(float)
    for e in trace.events:
        if e["pid"] == kind and e["name"] == name and e.get("ph") == "X":
            out[str(e["tid"])] += e.get("dur", 0) / 1e6
    return dict(out)


def tracer_cost(trace: Trace) -> dict[str, Any]:
    """What tracing cost, from each process's last cost counter: events, seconds, and the largest
    share of one process's traced time (its first event to its last counter) spent tracing."""
    last: dict[str, dict[str, Any]] = {}
    for e in trace.events:
        if e["pid"] == TRACER and e.get("ph") == "C":
            last[str(e["tid"])] = e  # events are in time order: the last one wins
    shares = {track: e["args"]["cost_us"] / max(e["ts"] - e["args"]["since_us"], 1) for track, e in last.items()}
    events = sum(e["args"]["events"] for e in last.values())
    cost_s = sum(e["args"]["cost_us"] for e in last.values()) / 1e6
    busiest = max(shares, key=shares.__getitem__, default=None)
    return {
        "processes": len(last),
        "events": events,
        "cost_s": cost_s,
        "us_per_event": cost_s * 1e6 / events if events else 0.0,
        "max_process_share": shares[busiest] if busiest else 0.0,
        "busiest_process": busiest,
    }


def summarize(trace: Trace, *, longest: int = 5) -> dict[str, Any]:
    """The numbers `streamrl trace` prints (a JSON-able dict)."""
    window_s = max((trace.end_us - trace.start_us) / 1e6, 1e-9)
    phases: dict[str, dict[str, float]] = {}
    for e in trace.events:
        if e.get("ph") == "X":
            row = phases.setdefault(f"{e['pid']}/{e['name']}", {"count": 0, "total_s": 0.0})
            row["count"] += 1
            row["total_s"] += e.get("dur", 0) / 1e6
    lives = trajectory_lives(trace)
    names = Counter(n for life in lives.values() for n in life.events)
    top = sorted(lives.values(), key=lambda life: life.seconds, reverse=True)[:longest]
    engine_busy = _span_seconds(trace, "engine", "busy")
    return {
        "window_s": window_s,
        "num_events": len(trace.events),
        "num_torn_lines": trace.num_torn,
        "phases": dict(sorted(phases.items())),
        "engine_busy": {k: v / window_s for k, v in sorted(engine_busy.items())},
        "learner_busy": sum(_span_seconds(trace, "learner", "train_step").values()) / window_s,
        "sync_pause_share": sum(_span_seconds(trace, "sync", "paused").values()) / window_s,
        "num_syncs": sum(1 for e in trace.events if e["pid"] == "sync" and e["name"] == "sync"),
        "trajectories": {
            "traced": len(lives),
            "trained": sum(1 for life in lives.values() if life.trained_step is not None),
            "parked": names["parked"],
            "resumed": names["resumed"],
        },
        "longest": [_life_row(life) for life in top],
        "tracer": tracer_cost(trace),
    }


def _life_row(life: TrajectoryLife) -> dict[str, Any]:
    return {
        "trajectory_id": life.trajectory_id,
        "seconds": life.seconds,
        "phases": {p: round(life.phases.get(p, 0.0), 4) for p in PHASES},
        "engines": sorted(life.engines),
        "versions": sorted(life.versions),
        "trained_step": life.trained_step,
        "path": " > ".join(_squash(life.events)),
    }


def _squash(names: list[str]) -> list[str]:
    """Event names with repeats in a row shown once (`generate x3`)."""
    out: list[str] = []
    count = 0
    for i, name in enumerate(names):
        count += 1
        if i + 1 == len(names) or names[i + 1] != name:
            out.append(name if count == 1 else f"{name} x{count}")
            count = 0
    return out


def format_summary(s: dict[str, Any]) -> str:
    """The summary as the lines `streamrl trace` prints."""
    t = s["trajectories"]
    lines = [
        f"window {s['window_s']:.1f}s, {s['num_events']} events"
        + (f", {s['num_torn_lines']} torn or malformed lines skipped" if s["num_torn_lines"] else ""),
        f"trajectories: {t['traced']} traced, {t['trained']} trained, {t['parked']} parks, {t['resumed']} resumes",
        "engine busy: " + (", ".join(f"{k} {v:.0%}" for k, v in s["engine_busy"].items()) or "-"),
        f"learner busy: {s['learner_busy']:.0%}   "
        f"sync pause share: {s['sync_pause_share']:.1%} ({s['num_syncs']} syncs)",
        "time per phase (count, total s):",
    ]
    c = s["tracer"]
    tracer_line = (
        f"tracer cost: {c['cost_s']:.3f}s for {c['events']} events ({c['us_per_event']:.1f} us each) in "
        f"{c['processes']} processes; at most {c['max_process_share']:.3%} of one process ({c['busiest_process']})"
    )
    lines += [f"  {name:<24} {row['count']:>7} {row['total_s']:>10.2f}" for name, row in s["phases"].items()]
    lines.append("longest trajectories:")
    for row in s["longest"]:
        step = row["trained_step"]
        lines.append(
            f"  {row['trajectory_id']}  {row['seconds']:.2f}s  versions {row['versions']}"
            f"  {'trained at step ' + str(step) if step is not None else 'not trained'}"
        )
        lines.append(f"    {row['path']}")
    lines.append(tracer_line)
    return "\n".join(lines)


__all__ = ["TrajectoryLife", "format_summary", "summarize", "tracer_cost", "trajectory_lives"]
