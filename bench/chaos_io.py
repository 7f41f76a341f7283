"""The chaos bench's I/O-fault family: a real tiny run whose buffer log meets ENOSPC, EIO, a torn
write or a failing fsync (`buffer/iofaults.py`, armed per segment through `STREAMRL_IO_FAULTS`, which
`core.faults.forwarded_env` hands to the buffer's actor).

Each faulted segment breaks one seeded call of one log for good: the log fails hard by design, so the
run must stop with a clear error (`LogFailedError`, "restart the run with --resume"); the next
segment resumes it. The same segments also make a share of the log's writes short (a legal partial
`write()` the writer must finish): survivable faults, counted apart. A last segment without any fault
must finish the run, and the invariants are checked over the log as for every scenario.

Counts come from the buffer actor's own log lines ("I/O fault injected: ..."), one per injected fault.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

IO_OVERRIDES = ["trainer.total_steps=8"]  # room for every segment's fault to land before the run ends
HARD_KINDS = ("enospc", "eio", "torn", "fsync_eio")  # a fault the log cannot survive
SHORT_RATE = 0.5  # share of write calls made short in each faulted segment
MAX_SHORT = 40  # short writes per segment at most
# What a segment stopped by a hard I/O fault must print: the error and the way out.
CLEAR_ERROR = re.compile(r"LogFailedError: buffer log \S+ failed .*restart the run with --resume")
_INJECTED = re.compile(r"I/O fault injected: (write|fsync) call #(\d+) on log (\w+): (\w+)")


def io_segments(seed: int, num_segments: int = 5) -> list[str]:
    """The `STREAMRL_IO_FAULTS` of each faulted segment: one hard fault at a seeded point, plus short
    writes drawn from the seed. The points come early in a segment (the first few admitted groups,
    the first checkpoint's fsync, the first consumed batch, the segment header at start-up) so the
    fault lands before the run can finish: a segment without its fault would end the run."""
    rng = random.Random(f"io-{seed}")
    points = [
        f"at=traj:write:{rng.randint(3, 12)}:torn",  # mid-admission, part of a frame on disk
        f"at=traj:write:{rng.randint(3, 12)}:enospc",
        f"at=traj:fsync:{rng.randint(0, 1)}:fsync_eio",  # a checkpoint's fsync (fsyncgate: never retried)
        f"at=consumed:write:{rng.randint(1, 2)}:eio",  # a learner step's consumption record
        "at=traj:write:0:eio",  # the new segment's header, at start-up: the disk is bad from the start
    ]
    rng.shuffle(points)
    return [
        f"seed={seed * 100 + i},rate={SHORT_RATE},kinds=short,max={MAX_SHORT},{point}"
        for i, point in enumerate(points[:num_segments])
    ]


def injected_faults(run_dir: Path) -> Counter[str]:
    """Injected I/O faults by kind, from every process log of the run (all its segments)."""
    counts: Counter[str] = Counter()
    for log in sorted((run_dir / "logs").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if match := _INJECTED.search(line):
                counts[match.group(4)] += 1
    return counts


def stopped_clearly(segment_output: str) -> bool:
    """Whether a segment's console output names the failed log and tells how to go on."""
    return bool(CLEAR_ERROR.search(segment_output))


def summarize_io(counts: Counter[str], segments: list[dict]) -> dict:
    """The family's fault counts, by kind, and how the hard-faulted segments stopped."""
    hard = sum(counts[k] for k in HARD_KINDS)
    faulted = [s for s in segments if s.get("io_faults")]
    return {
        "io_faults_injected": hard + counts["short"],
        "io_hard_faults": hard,  # each one fails the log for good: the run must stop
        "io_short_writes": counts["short"],  # survived: the writer finishes the write
        "io_faults_by_kind": dict(sorted(counts.items())),
        "io_segments_stopped_clearly": sum(bool(s.get("stopped_clearly")) for s in faulted),
        "io_segments_faulted": len(faulted),
    }
