"""Where a lifecycle trace lives on disk, and how it is kept bounded.

Each process of a run appends its events to its own shard (`core.trace`), and a shard is a sequence of
segments: `<track>.jsonl`, then `<track>.1.jsonl`, `<track>.2.jsonl`, ... (`track` is `<host>-<pid>`).
A process starts a new segment when its current one passes `trace.max_shard_mb`, and a process that
finds segments of its track already there (a pid reused by a resumed run) starts after them: a
segment is only ever appended to by one process.

When the trace folder passes `trace.max_total_mb`, the process that just rotated deletes the oldest
closed segments (any process's, oldest last write first) until the folder is under the cap again.
A segment is closed when its track has a newer one; the open segment of each process, and the last
one of a process that ended, are never deleted. So the folder holds at most the cap plus one
segment per process. Each deletion is appended to `RUN_DIR/trace/dropped.log`, one JSON line naming
the segment, its size and its number of events (lines), so the readers can say what the trace no
longer holds (`read_dropped`). Deciding and deleting take an exclusive lock on the folder's `.lock`
file: two processes rotating at once do not both drop for the same excess.

Nothing here imports more than the standard library: the writer runs inside every process of a run.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".jsonl"
DROPPED = "dropped.log"  # the ledger of segments deleted for the cap (not a segment: no .jsonl)
LOCK = ".lock"
MB = 1_000_000  # the limits' unit: `max_shard_mb`, `max_total_mb`


def segment_path(folder: Path, track: str, index: int) -> Path:
    """Segment `index` of `track`'s shard (the first one keeps the plain `<track>.jsonl`)."""
    return folder / (f"{track}{SUFFIX}" if index == 0 else f"{track}.{index}{SUFFIX}")


def segment_of(path: Path) -> tuple[str, int]:
    """(track, index) of a segment file. A track ends in `-<pid>`, so a last dotted part that is all
    digits is the index (host names may hold dots: `node1.cluster-42.3.jsonl` is segment 3)."""
    stem = path.name.removesuffix(SUFFIX)
    head, _, tail = stem.rpartition(".")
    return (head, int(tail)) if head and tail.isdigit() else (stem, 0)


def segments(folder: Path) -> list[Path]:
    """Every segment in the folder, grouped by track, each track's in the order they were written."""
    return sorted(folder.glob(f"*{SUFFIX}"), key=lambda p: (segment_of(p)[0], segment_of(p)[1]))


def next_index(folder: Path, track: str) -> int:
    """The index a new shard of `track` starts at: after any segment of that track already there."""
    taken = [i for t, i in map(segment_of, folder.glob(f"*{SUFFIX}")) if t == track]
    return max(taken) + 1 if taken else 0


def _count_lines(path: Path) -> int:
    lines = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
    return lines


def drop_past_cap(folder: Path, max_total_bytes: int, *, by: str) -> list[dict[str, object]]:
    """Delete the oldest closed segments while the folder holds more than `max_total_bytes`, recording
    each in the ledger (module docstring); returns the records. `by`: the deleting process's track."""
    dropped: list[dict[str, object]] = []
    with (folder / LOCK).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        found: list[tuple[Path, os.stat_result]] = []
        for path in folder.glob(f"*{SUFFIX}"):
            try:
                found.append((path, path.stat()))
            except FileNotFoundError:
                continue
        total = sum(st.st_size for _, st in found)
        newest: dict[str, int] = {}
        for path, _ in found:
            track, index = segment_of(path)
            newest[track] = max(newest.get(track, 0), index)
        closed = [
            (st.st_mtime, path, st.st_size) for path, st in found if segment_of(path)[1] < newest[segment_of(path)[0]]
        ]
        for mtime, path, size in sorted(closed):
            if total <= max_total_bytes:
                break
            record: dict[str, object] = {
                "segment": path.name,
                "track": segment_of(path)[0],
                "bytes": size,
                "events": _count_lines(path),
                "last_write_us": int(mtime * 1e6),
                "dropped_us": time.time_ns() // 1000,
                "by": by,
            }
            path.unlink()
            total -= size
            with (folder / DROPPED).open("a", encoding="utf-8") as ledger:
                ledger.write(json.dumps(record, separators=(",", ":")) + "\n")
            dropped.append(record)
    return dropped


@dataclass(kw_only=True, slots=True)
class Dropped:
    """What the cap deleted from a trace, from its ledger: segments, their events (lines) and bytes."""

    num_segments: int = 0
    num_events: int = 0
    num_bytes: int = 0


def read_dropped(folder: Path) -> Dropped:
    """The ledger summed (an unreadable or torn line is skipped: the count is then a lower bound)."""
    out = Dropped()
    try:
        lines = (folder / DROPPED).read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
            events, size = int(record["events"]), int(record["bytes"])
        except (ValueError, KeyError, TypeError):
            continue
        out.num_segments += 1
        out.num_events += events
        out.num_bytes += size
    return out


__all__ = [
    "DROPPED",
    "MB",
    "Dropped",
    "drop_past_cap",
    "next_index",
    "read_dropped",
    "segment_of",
    "segment_path",
    "segments",
]
