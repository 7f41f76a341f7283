"""The run's lifecycle trace: its switch (`TraceConfig`), and the merge of the per-process shards
(`core.trace`) into one Chrome trace-event file, `RUN_DIR/trace.json`, that Perfetto's UI
(ui.perfetto.dev) and chrome://tracing open.

Shards hold Chrome events whose `pid` / `tid` are names (`engine` / `engine-0`); the merged file numbers
them, in a stable order, and names every process and thread row with metadata events. A shard's last
line may be torn (its process was killed mid-write): such lines are counted and skipped, never fatal;
so are events the merge and the summary cannot use (no name, a `ts` or `dur` that is not a number):
one bad line must not cost the whole trace.
A window (seconds from the trace's first event) keeps the events that overlap it, clipped to it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from streamrl.core.atomic import atomic_write
from streamrl.core.run_dir import RunDir

logger = logging.getLogger(__name__)

# Process rows in the merged trace, top to bottom; kinds not listed follow in name order.
ROW_ORDER = ("driver", "learner", "sync", "engine", "buffer", "trajectory")


class TraceConfig(BaseModel):
    """`[trace]`: record the lifecycle of every trajectory, engine, learner step and weight sync
    into RUN_DIR/trace/ (merged by `streamrl trace RUN_DIR`; docs/trace.md)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False


@dataclass
class Trace:
    """The merged events of a run (Chrome events with named `pid` / `tid`, sorted by time)."""

    events: list[dict[str, Any]]
    num_torn: int = 0  # lines skipped: torn by a killed process, not JSON, or not a usable event
    shards: list[Path] = field(default_factory=list)

    @property
    def start_us(self) -> int:
        return min((e["ts"] for e in self.events), default=0)

    @property
    def end_us(self) -> int:
        return max((e["ts"] + e.get("dur", 0) for e in self.events), default=0)


def read_trace(run_dir: str | Path) -> Trace:
    """Every event of every shard under RUN_DIR/trace/, in time order."""
    shards = sorted(RunDir(run_dir).trace.glob("*.jsonl"))
    events: list[dict[str, Any]] = []
    torn = 0
    for shard in shards:
        for line in shard.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if _usable(event):
                events.append(event)
            else:
                torn += 1
    if torn:
        logger.warning("trace of %s: skipped %d torn or malformed lines", run_dir, torn)
    events.sort(key=lambda e: (e["ts"], e.get("ph") != "i", -e.get("dur", 0)))  # outer spans first
    return Trace(events=events, num_torn=torn, shards=shards)


def _usable(event: Any) -> bool:
    """A dict with a row (`pid`, `tid`), a `name`, a finite numeric `ts`, a numeric `dur` if any, and
    `args` a dict if any: what sorting, windowing and the summary read."""
    if not (isinstance(event, dict) and {"ts", "pid", "tid", "name"} <= event.keys()):
        return False
    times = (event["ts"], event.get("dur", 0))
    if not all(isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) for t in times):
        return False
    return isinstance(event.get("args", {}), dict)


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
    lo = origin + int(window[0] * 1e6)
    hi = origin + int(min(window[1], 1e12) * 1e6)
    kept = []
    for e in trace.events:
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        if end < lo or start > hi:
            continue
        if e.get("ph") == "X":
            start, end = max(start, lo), min(end, hi)
            e = {**e, "ts": start, "dur": end - start}
        kept.append(e)
    return Trace(events=kept, num_torn=trace.num_torn, shards=trace.shards)


def _row_key(kind: str) -> tuple[int, str]:
    return (ROW_ORDER.index(kind) if kind in ROW_ORDER else len(ROW_ORDER), kind)


def to_chrome(trace: Trace) -> dict[str, Any]:
    """The Chrome trace-event JSON object: numbered rows, named by metadata events."""
    kinds = sorted({str(e["pid"]) for e in trace.events}, key=_row_key)
    pids = {kind: i + 1 for i, kind in enumerate(kinds)}
    tids: dict[tuple[str, str], int] = {}
    for e in trace.events:
        tids.setdefault((str(e["pid"]), str(e["tid"])), len(tids) + 1)
    meta: list[dict[str, Any]] = []
    for kind, pid in pids.items():
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": kind}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for (kind, track), tid in tids.items():
        meta.append({"ph": "M", "name": "thread_name", "pid": pids[kind], "tid": tid, "args": {"name": track}})
    body = [{**e, "pid": pids[str(e["pid"])], "tid": tids[(str(e["pid"]), str(e["tid"]))]} for e in trace.events]
    return {"traceEvents": meta + body, "displayTimeUnit": "ms", "otherData": {"clock": "wall-clock epoch us"}}


def write_chrome(trace: Trace, path: str | Path) -> Path:
    """`trace` as a Chrome trace-event file at `path`, written atomically."""
    return atomic_write(Path(path), json.dumps(to_chrome(trace), separators=(",", ":")))


def export(run_dir: str | Path, window: tuple[float, float] | None = None, out: str | Path | None = None) -> Path:
    """Merge RUN_DIR/trace/*.jsonl into `out` (default RUN_DIR/trace.json)."""
    return write_chrome(windowed(read_trace(run_dir), window), out if out is not None else RunDir(run_dir).trace_json)


__all__ = ["Trace", "TraceConfig", "export", "parse_window", "read_trace", "to_chrome", "windowed", "write_chrome"]
