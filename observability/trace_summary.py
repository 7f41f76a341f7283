"""What a lifecycle trace says, in numbers: where the time went (per-phase totals), how busy the
engines and the learner were, what share of the time the weight syncs held generation paused, and
the longest trajectories with their phases. `streamrl trace` prints it; the report's timeline uses
the same reading (`trace_totals`, `trajectory_lives`).

Engine busy is the engine's `busy` spans (some request in flight) over the window; learner busy its
`train_step` spans; the sync pause share the syncs' `paused` spans (from the pause to the resume).
The tracer's cost is each process's last cost counter (`core.trace`): seconds spent tracing over the
span of its own events. The busiest process's share bounds what tracing can take from a pipeline
whose slowest part is one process (each of streamrl's parts is).

The summary reads a trace in two passes and keeps no event (`observability.tracing` streams them):
the first adds up the totals and keeps each trajectory's first and last time, the second collects
the events of the longest few only. Its memory is a few numbers per trajectory and per track.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from streamrl.core.trace import TRACER
from streamrl.observability.tracing import Events, time_key

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
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (name, ts us, dur us) of its spans
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
        life.spans.append((e["name"], e["ts"], e.get("dur", 0)))
    if "engine" in args:
        life.engines.add(str(args["engine"]))
    for key in ("min_version", "max_version"):
        if args.get(key) is not None and int(args[key]) >= 0:  # -1: no token sampled yet
            life.versions.add(int(args[key]))
    if e["name"] == "trained" and args.get("learner_step") is not None:
        life.trained_step = int(args["learner_step"])


def trajectory_lives(events: Iterable[dict[str, Any]], ids: set[str] | None = None) -> dict[str, TrajectoryLife]:
    """The lives of the traced trajectories named in `ids` (None: every one; that holds all their
    events at once, fine for a test or a window, not for a whole long trace), by id."""
    mine: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["pid"] == TRAJECTORY and (ids is None or str(e["tid"]) in ids):
            mine[str(e["tid"])].append(e)
    lives: dict[str, TrajectoryLife] = {}
    for tid, own in mine.items():
        own.sort(key=time_key)
        life = lives[tid] = TrajectoryLife(tid, own[0]["ts"], own[0]["ts"] + own[0].get("dur", 0))
        for e in own:
            _note(life, e)
    return lives


@dataclass
class TraceTotals:
    """The first pass of the summary: sums over every event, and each trajectory's extent."""

    start_us: int = 0
    end_us: int = 0
    num_events: int = 0
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # "kind/name" -> count, total_s
    engine_busy_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    learner_busy_s: float = 0.0
    sync_paused_s: float = 0.0
    num_syncs: int = 0
    extents: dict[str, list[int]] = field(default_factory=dict)  # trajectory id -> [start us, end us, trained]
    trajectory_names: Counter[str] = field(default_factory=Counter)  # event names of trajectory rows
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)  # process track -> its last cost counter

    @property
    def window_s(self) -> float:
        return max((self.end_us - self.start_us) / 1e6, 1e-9)

    def add(self, e: dict[str, Any]) -> None:
        kind, name, ts = e["pid"], e["name"], e["ts"]
        end = ts + e.get("dur", 0)
        self.start_us = ts if self.num_events == 0 else min(self.start_us, ts)
        self.end_us = end if self.num_events == 0 else max(self.end_us, end)
        self.num_events += 1
        if e.get("ph") == "X":
            row = self.phases.setdefault(f"{kind}/{name}", {"count": 0, "total_s": 0.0})
            row["count"] += 1
            row["total_s"] += e.get("dur", 0) / 1e6
            seconds = e.get("dur", 0) / 1e6
            if kind == "engine" and name == "busy":
                self.engine_busy_s[str(e["tid"])] += seconds
            elif kind == "learner" and name == "train_step":
                self.learner_busy_s += seconds
            elif kind == "sync" and name == "paused":
                self.sync_paused_s += seconds
        if kind == "sync" and name == "sync":
            self.num_syncs += 1
        if kind == TRAJECTORY:
            self._add_trajectory(e, ts, end)
        elif kind == TRACER and e.get("ph") == "C":
            track = str(e["tid"])
            last = self.counters.get(track)
            if last is None or (e["args"]["events"], ts) >= (last["args"]["events"], last["ts"]):
                self.counters[track] = e  # the running totals only grow: the largest is the last

    def _add_trajectory(self, e: dict[str, Any], ts: int, end: int) -> None:
        tid = str(e["tid"])
        self.trajectory_names[e["name"]] += 1
        extent = self.extents.get(tid)
        if extent is None:
            extent = self.extents[tid] = [ts, end, 0]
        else:
            extent[0], extent[1] = min(extent[0], ts), max(extent[1], end)
        if e["name"] == "trained" and e.get("args", {}).get("learner_step") is not None:
            extent[2] = 1

    def longest(self, k: int) -> list[str]:
        """The ids of the `k` trajectories with the longest first-to-last time (ties: the earlier first)."""
        ranked = sorted(self.extents.items(), key=lambda item: (item[1][0] - item[1][1], item[1][0], item[0]))
        return [tid for tid, _ in ranked[:k]]


def trace_totals(events: Iterable[dict[str, Any]]) -> TraceTotals:
    """One pass over `events`: the summary's sums (`TraceTotals`)."""
    totals = TraceTotals()
    for e in events:
        totals.add(e)
    return totals


def longest_lives(events: Iterable[dict[str, Any]], totals: TraceTotals, k: int) -> list[TrajectoryLife]:
    """The lives of the `k` longest trajectories (a second pass over the same `events`), longest first."""
    ids = totals.longest(k)
    lives = trajectory_lives(events, set(ids))
    return [lives[tid] for tid in ids if tid in lives]


def tracer_cost(source: Iterable[dict[str, Any]] | TraceTotals) -> dict[str, Any]:
    """What tracing cost, from each process's last cost counter: events, seconds, and the largest
    share of one process's traced time (its first event to its last counter) spent tracing."""
    last = (source if isinstance(source, TraceTotals) else trace_totals(source)).counters
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


def summarize(trace: Events, *, longest: int = 5) -> dict[str, Any]:
    """The numbers `streamrl trace` prints (a JSON-able dict), in two passes over `trace`."""
    totals = trace_totals(trace)
    return summary_of(totals, longest_lives(trace, totals, longest), trace)


def summary_of(totals: TraceTotals, longest: list[TrajectoryLife], trace: Events) -> dict[str, Any]:
    """The summary from its two passes (`trace`: the lines skipped, and what the cap deleted)."""
    window_s = totals.window_s
    names = totals.trajectory_names
    dropped = trace.dropped
    return {
        "window_s": window_s,
        "num_events": totals.num_events,
        "num_torn_lines": trace.num_torn,
        "dropped": {"segments": dropped.num_segments, "events": dropped.num_events, "bytes": dropped.num_bytes},
        "phases": dict(sorted(totals.phases.items())),
        "engine_busy": {k: v / window_s for k, v in sorted(totals.engine_busy_s.items())},
        "learner_busy": totals.learner_busy_s / window_s,
        "sync_pause_share": totals.sync_paused_s / window_s,
        "num_syncs": totals.num_syncs,
        "trajectories": {
            "traced": len(totals.extents),
            "trained": sum(extent[2] for extent in totals.extents.values()),
            "parked": names["parked"],
            "resumed": names["resumed"],
        },
        "longest": [_life_row(life) for life in longest],
        "tracer": tracer_cost(totals),
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
    dropped = s["dropped"]
    lines = [
        f"window {s['window_s']:.1f}s, {s['num_events']} events"
        + (f", {s['num_torn_lines']} torn or malformed lines skipped" if s["num_torn_lines"] else ""),
        *(
            [
                f"dropped for trace.max_total_mb: the oldest {dropped['events']} events "
                f"({dropped['segments']} segments, {dropped['bytes'] / 1e6:.1f} MB)"
            ]
            if dropped["segments"]
            else []
        ),
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


__all__ = [
    "TraceTotals",
    "TrajectoryLife",
    "format_summary",
    "longest_lives",
    "summarize",
    "summary_of",
    "trace_totals",
    "tracer_cost",
    "trajectory_lives",
]
