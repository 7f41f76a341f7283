"""The chaos bench's I/O-fault family: a real tiny run whose buffer log, learner checkpoints and run
files meet ENOSPC, EIO, a torn write or a failing fsync (`core/iofaults.py`, armed per segment
through `STREAMRL_IO_FAULTS`, which `core.faults.forwarded_env` hands to every actor: the buffer's
writes its logs, the learner's its checkpoints, the driver its `driver_state.json`).

Each faulted segment breaks one seeded call of one target for good, and the run must stop with a
clear error naming what failed: a buffer log fails hard by design (`LogFailedError`, "restart the run
with --resume"); a checkpoint is left unsealed and removed (`CheckpointWriteError`: errno, file,
--resume); a run file keeps its previous content (`WriteFailedError`: errno, file, "intact"). The next
segment resumes the run: from the newest complete checkpoint, with every acknowledged row in the log.
The same segments also make a share of all these writes short (a legal partial `write()` the writer
must finish): survivable faults, counted apart. A last segment without any fault must finish the
run, and the invariants are checked over the log as for every scenario.

Counts come from the processes' own log lines ("I/O fault injected: ..."), one per injected fault,
by kind and by target (`buffer`, `checkpoint`, `run_file`).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

from streamrl.core.run_dir import RunDir

IO_OVERRIDES = ["trainer.total_steps=8"]  # room for every segment's fault to land before the run ends
HARD_KINDS = ("enospc", "eio", "torn", "fsync_eio")  # a fault the writer cannot survive: the run stops
TARGETS = ("buffer", "checkpoint", "run_file")  # what a fault hit (`target`)
SHORT_RATE = 0.5  # share of write calls made short in each faulted segment
MAX_SHORT = 40  # short writes per segment at most
# What a segment stopped by a hard I/O fault must print: the error, the file or log, and the way out
# (a checkpoint's and a run file's error also name the errno).
CLEAR_ERROR = re.compile(
    r"LogFailedError: buffer log \S+ failed .*restart the run with --resume"
    r"|CheckpointWriteError: \[Errno \d+\] saving the checkpoint .* failed: E[A-Z]+ (writing|syncing) .*--resume"
    r"|WriteFailedError: \[Errno \d+\] E[A-Z]+ writing \S+: .*intact"
)
_INJECTED = re.compile(r"I/O fault injected: (write|fsync) call #(\d+) on log ([\w./-]+): (\w+)")
SEAL = "SEALED.json"  # core.atomic.SEAL (the bench plans faults without importing the trainer)


def io_segments(seed: int, num_segments: int | None = None) -> list[str]:
    """The `STREAMRL_IO_FAULTS` of each faulted segment (all points unless `num_segments`): one hard
    fault at a seeded point, plus short writes drawn from the seed. The points come early in a segment
    (the first few admitted groups, the first checkpoint, the first consumed batch, the segment header
    at start-up) so the fault lands before the run can finish: a segment without its fault would end
    the run. Calls are counted per process, so `ckpt/...` points land in this segment's learner and
    `run/driver_state.json` points in its driver."""
    rng = random.Random(f"io-{seed}")
    points = [
        f"at=traj:write:{rng.randint(3, 12)}:torn",  # mid-admission, part of a frame on disk
        f"at=traj:write:{rng.randint(3, 12)}:enospc",
        f"at=traj:fsync:{rng.randint(0, 1)}:fsync_eio",  # a checkpoint's fsync (fsyncgate: never retried)
        f"at=consumed:write:{rng.randint(1, 2)}:eio",  # a learner step's consumption record
        "at=traj:write:0:eio",  # the new segment's header, at start-up: the disk is bad from the start
        # the segment's first learner checkpoint: its optimizer state (dozens of writes), its seal, the
        # model weights' fsync; the checkpoint must not be sealed, the resume takes the one before
        f"at=ckpt/optimizer.pt:write:{rng.randint(0, 20)}:enospc",
        f"at=ckpt/{SEAL}:write:0:torn",
        "at=ckpt/hf/model.safetensors:fsync:0:fsync_eio",
        # the driver state, saved after every admitted group: the previous file must stay intact
        f"at=run/driver_state.json:write:{rng.randint(2, 12)}:eio",
        f"at=run/driver_state.json:fsync:{rng.randint(2, 12)}:fsync_eio",
    ]
    rng.shuffle(points)
    return [
        f"seed={seed * 100 + i},rate={SHORT_RATE},kinds=short,max={MAX_SHORT},{point}"
        for i, point in enumerate(points[:num_segments])
    ]


def target(log: str) -> str:
    """What an injected fault's target (`core.iofaults` module doc) belongs to."""
    if log.startswith("ckpt/"):
        return "checkpoint"
    if log.startswith("run/"):
        return "run_file"
    return "buffer"


def _injected(run_dir: Path) -> list[tuple[str, str]]:
    """(target, kind) of every injected I/O fault, from every process log of the run (all its segments)."""
    found = []
    for log in sorted(RunDir(run_dir).logs.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if match := _INJECTED.search(line):
                found.append((match.group(3), match.group(4)))
    return found


def injected_faults(run_dir: Path) -> Counter[str]:
    """Injected I/O faults by kind, from every process log of the run (all its segments)."""
    return Counter(kind for _, kind in _injected(run_dir))


def hard_faults_by_target(run_dir: Path) -> Counter[str]:
    """Injected hard I/O faults by what they hit: `buffer`, `checkpoint`, `run_file`."""
    return Counter(target(log) for log, kind in _injected(run_dir) if kind in HARD_KINDS)


def stopped_clearly(segment_output: str) -> bool:
    """Whether a segment's console output names the failed log and tells how to go on."""
    return bool(CLEAR_ERROR.search(segment_output))


def summarize_io(counts: Counter[str], segments: list[dict], by_target: Counter[str] | None = None) -> dict:
    """The family's fault counts, by kind and (hard ones) by target, and how the hard-faulted
    segments stopped."""
    hard = sum(counts[k] for k in HARD_KINDS)
    faulted = [s for s in segments if s.get("io_faults")]
    return {
        "io_faults_injected": hard + counts["short"],
        "io_hard_faults": hard,  # each one fails its writer for good: the run must stop
        "io_short_writes": counts["short"],  # survived: the writer finishes the write
        "io_faults_by_kind": dict(sorted(counts.items())),
        "io_hard_faults_by_target": {t: (by_target or Counter())[t] for t in TARGETS},
        "io_segments_stopped_clearly": sum(bool(s.get("stopped_clearly")) for s in faulted),
        "io_segments_faulted": len(faulted),
    }
