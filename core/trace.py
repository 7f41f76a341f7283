"""Lifecycle tracing: spans and instants of every part of a run, one JSONL shard per process.

The parts of a run are Ray actors in different processes (and nodes), any of which may be killed at
any moment. Each process therefore appends its own events to `RUN_DIR/trace/<host>-<pid>.jsonl`,
one JSON object per line, written line-buffered (each event reaches the OS as soon as it is made, so
a SIGKILLed process loses nothing it recorded); `streamrl trace RUN_DIR` merges the shards into one
Chrome trace-event file (`observability.tracing`). One clock for all: wall-clock epoch microseconds.

The trace is bounded on disk (`core.trace_segments`): a shard rotates to a new segment file past
`trace.max_shard_mb` (`SHARD_MB`), and past `trace.max_total_mb` (`TOTAL_MB`) the oldest closed
segments are deleted, each deletion recorded in the trace folder's ledger for the readers to report.

An event is a Chrome trace event whose `pid` and `tid` are names, not numbers: `pid` the kind of
track (`trajectory`, `engine`, `learner`, `sync`, `buffer`, `driver`), `tid` the track itself (a
trajectory id, `engine-0`, ...). The exporter numbers them and names the rows. `args` carry what joins
an event to the training data: trajectory id, attempt, policy version, learner step.

The tracer accounts for itself: each shard adds up the time spent making and writing its events and,
every `COST_EVERY` events or `COST_EVERY_S` seconds, writes a counter event (`pid` `tracer`, name
`tracer <host>-<pid>`) with the running totals and the time of the shard's first event. The summary
divides one by the other: the share of each process's traced time that went to tracing.

A trace never fails what it traces: a shard that cannot be created or written (ENOSPC, EIO) drops the
event, counts the failed write (`num_write_errors`, and `write_errors` in the shard's next cost
counter) and logs once per process; the append, the sync or the step it would have recorded goes on.

Off unless the run's config says `trace.enabled = true`. The driver calls `configure`; an actor
process finds its run through `RUN_DIR_ENV` (set for every actor by `ray.init`) and reads the switch
and the limits from the run's `RunInfo` (`core.run_dir`) once, at its first event. Off, `span`
returns a shared no-op context and `instant` / `complete` return after one global lookup: cheap
enough to leave in hot paths.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from streamrl.core import trace_segments
from streamrl.core.run_dir import RunDir

RUN_DIR_ENV = "STREAMRL_RUN_DIR"  # the run directory, for every actor process of the run
TRACER = "tracer"  # the `pid` of the tracer's own cost counters
COST_EVERY = 512  # events between two cost counters of a shard
COST_EVERY_S = 5.0  # ... or seconds, whichever comes first (a quiet process still reports)
# At the rate of the async benchmark (bench/results/trace_overhead.json: ~150 events/s of ~200 bytes,
# ~30 KB/s for the whole run) the busiest process fills a segment in under an hour and the cap holds
# the last ~9 hours: enough to diagnose, and a bound on the disk a forgotten `trace.enabled` takes.
SHARD_MB = 32.0  # `trace.max_shard_mb`: a process's shard starts a new segment past this size
TOTAL_MB = 1024.0  # `trace.max_total_mb`: past this, the oldest closed segments are deleted

_UNSET: Any = object()
logger = logging.getLogger(__name__)
_num_write_errors = 0  # writes of this process's trace that failed (every shard it had)


def _write_failed(path: Path, exc: Exception) -> None:
    """Count a write lost to an error of the trace's own file; warn at the process's first."""
    global _num_write_errors
    _num_write_errors += 1
    if _num_write_errors == 1:
        logger.warning("trace: cannot write %s (%s): events are dropped and counted, the run goes on", path, exc)


def num_write_errors() -> int:
    """Writes of this process's trace (events, cost counters, a shard's creation) that failed."""
    return _num_write_errors


class _Shard:
    """This process's shard: append-only, line-buffered JSONL segment files (one lock: threads share
    it), rotated past `max_shard_mb`; and the tracer's own cost in this process (events written,
    nanoseconds spent making them, rotations and the drops for the cap included)."""

    def __init__(self, run_dir: Path, max_shard_mb: float = SHARD_MB, max_total_mb: float = TOTAL_MB) -> None:
        self.folder = RunDir(run_dir).trace
        self.folder.mkdir(parents=True, exist_ok=True)
        self.track = f"{socket.gethostname()}-{os.getpid()}"
        self.max_shard_bytes = int(max_shard_mb * trace_segments.MB)
        self.max_total_bytes = int(max_total_mb * trace_segments.MB)
        self.segment = trace_segments.next_index(self.folder, self.track)
        self.path = trace_segments.segment_path(self.folder, self.track, self.segment)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the process)
        self._bytes = 0  # written to the current segment
        self._lock = threading.Lock()
        self.events = 0
        self.write_errors = 0
        self.num_dropped = 0  # segments this process deleted for the cap
        self.cost_ns = 0
        self.first_us: int | None = None
        self._last_us = 0
        self._counted_at = time.monotonic()

    def write(self, event: dict[str, Any], started_ns: int) -> None:
        """Append `event`; `started_ns` (`perf_counter_ns`) is when its caller began making it."""
        line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if not self._guarded(self._file.write, line):
                return
            self.events += 1
            self._bytes += len(line)  # ASCII: json.dumps escapes the rest
            self.first_us = event["ts"] if self.first_us is None else self.first_us
            self._last_us = max(self._last_us, event["ts"] + event.get("dur", 0))
            if self.events % COST_EVERY == 0 or time.monotonic() - self._counted_at >= COST_EVERY_S:
                self._guarded(self._write_cost)
            if self._bytes >= self.max_shard_bytes:
                self._guarded(self._rotate)
            self.cost_ns += time.perf_counter_ns() - started_ns

    def _rotate(self) -> None:
        """Go on in the next segment, then hold the folder to its cap. Called under the lock. A new
        segment that cannot be opened leaves the current one in use (retried a segment's size later)."""
        self._bytes = 0
        path = trace_segments.segment_path(self.folder, self.track, self.segment + 1)
        new = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the process)
        old, self._file, self.path, self.segment = self._file, new, path, self.segment + 1
        old.close()
        dropped = trace_segments.drop_past_cap(self.folder, self.max_total_bytes, by=self.track)
        if dropped and not self.num_dropped:
            logger.info(
                "trace: past trace.max_total_mb = %g, deleting the oldest segments (recorded in %s)",
                self.max_total_bytes / trace_segments.MB,
                self.folder / trace_segments.DROPPED,
            )
        self.num_dropped += len(dropped)

    def _guarded(self, write: Callable[..., object], *args: Any) -> bool:
        """One write to the shard's file; an error of the file is counted, never raised (module docstring).
        ValueError: a shard `configure` closed under a thread still writing to it."""
        try:
            write(*args)
        except (OSError, ValueError) as exc:
            self.write_errors += 1
            _write_failed(self.path, exc)
            return False
        return True

    def _write_cost(self) -> None:
        """The running totals as a Chrome counter event, stamped with the last event's time (so that
        counters never widen the trace's window). Called under the lock."""
        args = {"events": self.events, "cost_us": self.cost_ns // 1000, "since_us": self.first_us}
        args |= {"write_errors": self.write_errors} if self.write_errors else {}
        event = {"ph": "C", "name": f"{TRACER} {self.track}", "cat": TRACER, "ts": self._last_us}
        self._file.write(json.dumps(event | {"pid": TRACER, "tid": self.track, "args": args}) + "\n")
        self._counted_at = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self.events:
                self._guarded(self._write_cost)
            self._guarded(self._file.close)  # closes the file even when its last flush fails


_shard: _Shard | None = _UNSET


def configure(run_dir: str | Path | None, *, max_shard_mb: float = SHARD_MB, max_total_mb: float = TOTAL_MB) -> None:
    """Trace this process into `run_dir` (None: tracing off here), within the run's disk limits. The
    driver calls it with the run's config; actor processes need not (`_from_env`)."""
    global _shard
    if isinstance(_shard, _Shard):
        _shard.close()
    _shard = _Shard(Path(run_dir), max_shard_mb, max_total_mb) if run_dir is not None else None


def _limit(trace_cfg: dict[str, Any], key: str, default: float) -> float:
    """A positive number from the run's saved `[trace]` (validated when the run started), else `default`."""
    value = trace_cfg.get(key)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return float(value) if ok else default


def _from_env() -> _Shard | None:
    """An actor process's shard: its run from `RUN_DIR_ENV`, on when the run's config says so."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    try:
        info = RunDir(run_dir).info()
    except (OSError, ValueError):
        return None
    trace_cfg = info.config.get("trace", {})
    if not (isinstance(trace_cfg, dict) and trace_cfg.get("enabled")):
        return None
    limits = _limit(trace_cfg, "max_shard_mb", SHARD_MB), _limit(trace_cfg, "max_total_mb", TOTAL_MB)
    try:
        return _Shard(Path(run_dir), *limits)
    except OSError as exc:  # this process goes untraced rather than failing its first traced call
        _write_failed(RunDir(run_dir).trace, exc)
        return None


def _current() -> _Shard | None:
    global _shard
    if _shard is _UNSET:
        _shard = _from_env()
    return _shard


def enabled() -> bool:
    """Whether this process records events (callers skip building costly args when it does not)."""
    return _current() is not None


def now_us() -> int:
    return time.time_ns() // 1000


def complete(name: str, cat: str, track: str, start_s: float, end_s: float | None = None, **args: Any) -> None:
    """A span known after the fact, from `start_s` to `end_s` (wall-clock `time.time()` seconds; None = now)."""
    shard = _current()
    if shard is None:
        return
    started = time.perf_counter_ns()
    start = int(start_s * 1e6)
    end = now_us() if end_s is None else int(end_s * 1e6)
    event = {"ph": "X", "name": name, "cat": cat, "ts": start, "dur": max(end - start, 0), "pid": cat, "tid": track}
    shard.write(event | {"args": args} if args else event, started)


def instant(name: str, cat: str, track: str, **args: Any) -> None:
    """A point event on `track` (admitted, appended, sampled, trained, ...)."""
    shard = _current()
    if shard is None:
        return
    started = time.perf_counter_ns()
    event = {"ph": "i", "s": "t", "name": name, "cat": cat, "ts": now_us(), "pid": cat, "tid": track}
    shard.write(event | {"args": args} if args else event, started)


class _Span(AbstractContextManager):
    __slots__ = ("name", "cat", "track", "args", "start")

    def __init__(self, name: str, cat: str, track: str, args: dict[str, Any]) -> None:
        self.name, self.cat, self.track, self.args = name, cat, track, args
        self.start = 0.0

    def __enter__(self) -> _Span:
        self.start = time.time()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.args["error"] = exc_type.__name__
        complete(self.name, self.cat, self.track, self.start, **self.args)

    def set(self, **args: Any) -> None:
        """Add args known only at the end (tokens generated, the version served, ...)."""
        self.args.update(args)


class _NoSpan:
    """What `span` returns when tracing is off: `set` does nothing."""

    def set(self, **args: Any) -> None:
        return None


_NO_SPAN = _NoSpan()
_NULL = nullcontext(_NO_SPAN)  # stateless: one shared instance serves every call


def span(name: str, cat: str, track: str, **args: Any) -> AbstractContextManager[Any]:
    """`with span("stage", "sync", "sync", policy_version=3) as s: ...; s.set(bytes=n)` records one
    complete event over the block (with `error` when it raised); a no-op when tracing is off."""
    if _current() is None:
        return _NULL
    return _Span(name, cat, track, args)


__all__ = [
    "RUN_DIR_ENV",
    "SHARD_MB",
    "TOTAL_MB",
    "TRACER",
    "complete",
    "configure",
    "enabled",
    "instant",
    "now_us",
    "span",
]
