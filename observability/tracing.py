"""The run's lifecycle trace: its config (`TraceConfig`), the reading of the per-process shards
(`core.trace`), and their merge into one Chrome trace-event file, `RUN_DIR/trace.json`, that
Perfetto's UI (ui.perfetto.dev) and chrome://tracing open.

A trace can be far larger than the memory a reader should take (hours of a run are hundreds of MB,
and Python holds a parsed event in ten times its bytes), so readers stream it: `open_trace` gives a
`TraceStream`, which reads every segment line by line each time it is iterated, and the merge and the
summary (`observability.trace_summary`) aggregate as they go; their memory follows what they keep
(one entry per track), not the number of events. `read_trace` loads a whole trace, time-sorted, for
tests and small traces.

Shards hold Chrome events whose `pid` / `tid` are names (`engine` / `engine-0`); the merged file numbers
them (the known kinds in `ROW_ORDER`, others as they first appear) and names every process and thread
row with metadata events, written where the row first appears (the format does not need events sorted).
A shard's last line may be torn (its process was killed mid-write): such lines are counted and skipped,
never fatal; so are events the merge and the summary cannot use (no name, a `ts` or `dur` that is not a
number): one bad line must not cost the whole trace. Segments deleted for `trace.max_total_mb` are
reported from the trace folder's ledger (`core.trace_segments`).
A window (seconds from the trace's first event) keeps the events that overlap it, clipped to it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.core import trace_segments
from streamrl.core.run_dir import RunDir
from streamrl.core.trace import SHARD_MB, TOTAL_MB
from streamrl.core.trace_segments import Dropped

logger = logging.getLogger(__name__)

# Process rows in the merged trace, top to bottom; kinds not listed follow in the order they appear.
ROW_ORDER = ("driver", "learner", "sync", "engine", "buffer", "trajectory")


class TraceConfig(BaseModel):
    """`[trace]`: record the lifecycle of every trajectory, engine, learner step and weight sync
    into RUN_DIR/trace/ (merged by `streamrl trace RUN_DIR`; docs/trace.md), within a disk budget."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    # MB = 10^6 bytes. A process's shard starts a new segment file past `max_shard_mb`; past
    # `max_total_mb` the oldest closed segments are deleted (recorded in trace/dropped.log).
    max_shard_mb: float = Field(SHARD_MB, gt=0)
    max_total_mb: float = Field(TOTAL_MB, gt=0)

    @model_validator(mode="after")
    def _check(self) -> TraceConfig:
        if self.max_total_mb < self.max_shard_mb:
            raise ValueError(
                f"trace.max_total_mb ({self.max_total_mb:g}) must hold at least one segment "
                f"(trace.max_shard_mb = {self.max_shard_mb:g})"
            )
        return self


class Events(Protocol):
    """What the summary reads: events it may iterate more than once, the lines skipped as torn or
    malformed, and what the cap deleted."""

    num_torn: int
    dropped: Dropped

    def __iter__(self) -> Iterator[dict[str, Any]]: ...


def time_key(event: dict[str, Any]) -> tuple[int, bool, int]:
    """Time order, outer spans before the spans and instants they contain."""
    return event["ts"], event.get("ph") != "i", -event.get("dur", 0)


class TraceStream:
    """A run's trace, read from its segments each time it is iterated: shard by shard, line by line,
    one event in memory at a time (`clip_us`: keep the events overlapping [lo, hi] µs, spans clipped).
    `num_torn` and the bounds of the events yielded (`start_us`, `end_us`) are those of the last full
    iteration; `start_us` makes one if none was made."""

    def __init__(self, shards: list[Path], dropped: Dropped, clip_us: tuple[int, int] | None = None) -> None:
        self.shards = shards
        self.dropped = dropped
        self.clip_us = clip_us
        self.num_torn = 0
        self._bounds: tuple[int, int] | None = None
        self._warned = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        torn, lo, hi = 0, None, 0  # lo: None until an event is seen
        for shard in self.shards:
            try:
                f = shard.open(encoding="utf-8", errors="replace")
            except FileNotFoundError:  # deleted for the cap since the listing
                continue
            with f:
                for line in f:
                    event = _parse(line)
                    if event is None:
                        torn += 1
                        continue
                    if self.clip_us is not None:
                        clipped = clip(event, *self.clip_us)
                        if clipped is None:
                            continue
                        event = clipped
                    lo = event["ts"] if lo is None else min(lo, event["ts"])
                    hi = max(hi, event["ts"] + event.get("dur", 0))
                    yield event
        self.num_torn, self._bounds = torn, (lo if lo is not None else 0, hi)
        if torn and not self._warned:
            logger.warning("trace: skipped %d torn or malformed lines", torn)
            self._warned = True

    def _read_bounds(self) -> tuple[int, int]:
        if self._bounds is None:
            for _ in self:
                pass
        assert self._bounds is not None
        return self._bounds

    @property
    def start_us(self) -> int:
        return self._read_bounds()[0]

    @property
    def end_us(self) -> int:
        return self._read_bounds()[1]

    def windowed(self, window: tuple[float, float] | None) -> TraceStream:
        """The events overlapping `window` (seconds from this trace's first event), spans clipped."""
        if window is None:
            return self
        origin = self.start_us
        clip_us = origin + int(window[0] * 1e6), origin + int(min(window[1], 1e12) * 1e6)
        return TraceStream(self.shards, self.dropped, clip_us)


def open_trace(run_dir: str | Path) -> TraceStream:
    """The trace under RUN_DIR/trace/, to be streamed (nothing is read until it is iterated)."""
    folder = RunDir(run_dir).trace
    return TraceStream(trace_segments.segments(folder), trace_segments.read_dropped(folder))


@dataclass
class Trace:
    """A whole trace in memory (Chrome events with named `pid` / `tid`, sorted by time)."""

    events: list[dict[str, Any]]
    num_torn: int = 0  # lines skipped: torn by a killed process, not JSON, or not a usable event
    shards: list[Path] = field(default_factory=list)
    dropped: Dropped = field(default_factory=Dropped)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.events)

    @property
    def start_us(self) -> int:
        return min((e["ts"] for e in self.events), default=0)

    @property
    def end_us(self) -> int:
        return max((e["ts"] + e.get("dur", 0) for e in self.events), default=0)


def read_trace(run_dir: str | Path) -> Trace:
    """Every event of every segment under RUN_DIR/trace/, in time order, in memory (tests and small
    traces; `streamrl trace` and the report stream: `open_trace`)."""
    stream = open_trace(run_dir)
    events = sorted(stream, key=time_key)
    return Trace(events=events, num_torn=stream.num_torn, shards=stream.shards, dropped=stream.dropped)


def _parse(line: str) -> dict[str, Any] | None:
    """The event on one line, or None for a torn, non-JSON or unusable one."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if _usable(event) else None


def _usable(event: Any) -> bool:
    """A dict with a row (`pid`, `tid`), a `name`, a finite numeric `ts`, a numeric `dur` if any, and
    `args` a dict if any: what sorting, windowing and the summary read."""
    if not (isinstance(event, dict) and {"ts", "pid", "tid", "name"} <= event.keys()):
        return False
    times = (event["ts"], event.get("dur", 0))
    if not all(isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) for t in times):
        return False
    return isinstance(event.get("args", {}), dict)


def clip(event: dict[str, Any], lo: int, hi: int) -> dict[str, Any] | None:
    """`event` if it overlaps [lo, hi] µs (a span clipped to it), else None."""
    start, end = event["ts"], event["ts"] + event.get("dur", 0)
    if end < lo or start > hi:
        return None
    if event.get("ph") == "X":
        start, end = max(start, lo), min(end, hi)
        return {**event, "ts": start, "dur": end - start}
    return event


def parse_window(text: str | None) -> tuple[float, float] | None:
    """`A:B` seconds from the trace's start (either side may be empty: open); None for no window."""
    if not text:
        return None
    if ":" not in text:
        raise ValueError(f"--window {text!r} is not A:B (seconds from the trace's start, e.g. 10:60)")
    a, b = text.split(":", 1)
    lo, hi = float(a) if a else 0.0, float(b) if b else float("inf")
    if hi <= lo:
        raise ValueError(f"--window {text!r}: the end must be after the start")
    return lo, hi


def windowed(trace: Trace, window: tuple[float, float] | None) -> Trace:
    """The events overlapping `window` (seconds from the trace's start), spans clipped to it."""
    if window is None:
        return trace
    origin = trace.start_us
    lo, hi = origin + int(window[0] * 1e6), origin + int(min(window[1], 1e12) * 1e6)
    kept = [c for e in trace.events if (c := clip(e, lo, hi)) is not None]
    return Trace(events=kept, num_torn=trace.num_torn, shards=trace.shards, dropped=trace.dropped)


class _Rows:
    """Numbers the merged file's rows as they first appear and makes their metadata events."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.tids: dict[tuple[str, str], int] = {}

    def number(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The metadata of rows `event` opens, then `event` with numbered `pid` and `tid`."""
        out: list[dict[str, Any]] = []
        kind, track = str(event["pid"]), str(event["tid"])
        pid = self.pids.get(kind)
        if pid is None:
            pid = ROW_ORDER.index(kind) + 1 if kind in ROW_ORDER else len(ROW_ORDER) + 1 + len(self.pids)
            self.pids[kind] = pid
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": kind}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        tid = self.tids.get((kind, track))
        if tid is None:
            tid = self.tids[(kind, track)] = len(self.tids) + 1
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
        out.append({**event, "pid": pid, "tid": tid})
        return out


_HEAD = '{"traceEvents":['
_TAIL = '],"displayTimeUnit":"ms","otherData":{"clock":"wall-clock epoch us"}}'


def to_chrome(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace-event JSON object, in memory: numbered rows, named by metadata events."""
    rows = _Rows()
    return json.loads(_HEAD + ",".join(json.dumps(e) for event in events for e in rows.number(event)) + _TAIL)


def write_chrome(events: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """`events` as a Chrome trace-event file at `path`, written as they stream by and renamed into
    place when whole (a reader never sees half a file)."""
    path = Path(path)
    rows = _Rows()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_HEAD)
            sep = ""
            for event in events:
                for e in rows.number(event):
                    f.write(sep + json.dumps(e, separators=(",", ":")))
                    sep = ","
            f.write(_TAIL)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def export(run_dir: str | Path, window: tuple[float, float] | None = None, out: str | Path | None = None) -> Path:
    """Merge RUN_DIR/trace/ into `out` (default RUN_DIR/trace.json), streaming."""
    return write_chrome(open_trace(run_dir).windowed(window), out if out is not None else RunDir(run_dir).trace_json)


__all__ = [
    "Events",
    "Trace",
    "TraceConfig",
    "TraceStream",
    "clip",
    "export",
    "open_trace",
    "parse_window",
    "read_trace",
    "time_key",
    "to_chrome",
    "windowed",
    "write_chrome",
]
