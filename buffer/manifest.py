"""The buffer directory's manifest, its single-writer lock, and the consumption-log schema.

`manifest.json` lists the segments of both logs with their frame counts; recovery uses it to notice
segments that went missing or came back short. It is rewritten atomically (temp file + rename) at
open, when a segment rolls, at checkpoint (fsync'd) and at close. A directory is written by one
process at a time, enforced with an advisory `flock` on `LOCK` (released by the OS if that process is
killed, so a crashed writer never blocks recovery).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from streamrl.buffer.schema import SCHEMA_VERSION
from streamrl.core.atomic import atomic_write

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TRAJ_PREFIX = "traj"
CONSUMED_PREFIX = "consumed"
FORMAT_VERSION = 1

# One row per use of a trajectory (op "consume"), or a rollback marker (op "rollback"; trajectory_id
# null): consumption at learner_step > the marker's learner_step, recorded before it, is undone.
CONSUMPTION_SCHEMA = pa.schema(
    [
        pa.field("op", pa.string(), nullable=False),
        pa.field("trajectory_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("learner_step", pa.int64(), nullable=False),
        pa.field("learner_version", pa.int64(), nullable=False),  # the served version (on-disk name kept)
        pa.field("lag", pa.int32(), nullable=False),  # served_version - min_policy_version
        pa.field("consumed_at", pa.float64(), nullable=False),
    ]
)


def read_manifest(root: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, problem): a missing manifest is not a problem (fresh dir or crash before the first
    write); an unreadable one is reported and recovery goes on from the segment files alone."""
    path = root / MANIFEST
    if not path.exists():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON, bad UTF-8, an over-long integer
        return None, f"{MANIFEST} is unreadable ({e}); recovering from segment files alone"
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        version = data.get("format_version") if isinstance(data, dict) else None
        return None, f"{MANIFEST}: unsupported format_version {version!r}; ignored"
    if (problem := _malformed_segments(data.get("segments", {}))) is not None:
        return None, f"{MANIFEST} is malformed ({problem}); recovering from segment files alone"
    return data, None


def _malformed_segments(segments: Any) -> str | None:
    """What is wrong with a manifest's `segments` (prefix -> [{name, num_frames}]), or None."""
    if not isinstance(segments, dict):
        return f"'segments' is a {type(segments).__name__}, not an object"
    for prefix, entries in segments.items():
        if not isinstance(entries, list):
            return f"segments of {prefix!r} are a {type(entries).__name__}, not a list"
        for entry in entries:
            ok = (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and type(entry.get("num_frames")) is int
                and entry["num_frames"] >= 0
            )
            if not ok:
                return f"segment entry {entry!r:.80} of {prefix!r} lacks a name or a frame count"
    return None


def write_manifest(root: Path, segments: dict[str, list[dict[str, Any]]], *, sync: bool) -> None:
    payload = {
        "format_version": FORMAT_VERSION,
        "schema_version": SCHEMA_VERSION,
        "updated_at": time.time(),
        "segments": segments,
    }
    atomic_write(root / MANIFEST, json.dumps(payload, indent=1), sync=sync)


class DirLock:
    """Exclusive advisory lock on `<root>/LOCK` for the lifetime of a writer."""

    def __init__(self, root: Path) -> None:
        self._file = open(root / "LOCK", "a+")  # noqa: SIM115 (held until release)
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            self._file.close()
            raise ValueError(f"buffer dir {root} is open by another writer process") from e
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()


def rollback_record(learner_step: int) -> pa.RecordBatch:
    """The consumption-log record that rolls back consumption recorded after `learner_step`."""
    return pa.RecordBatch.from_pylist(
        [
            {
                "op": "rollback",
                "trajectory_id": None,
                "group_id": None,
                "learner_step": learner_step,
                "learner_version": -1,
                "lag": 0,
                "consumed_at": time.time(),
            }
        ],
        schema=CONSUMPTION_SCHEMA,
    )


def consume_records(table: pa.Table, lags: np.ndarray, learner_step: int, served_version: int) -> pa.RecordBatch:
    """The consumption-log records of one sampled batch (`table`: its trajectory rows, `lags` per row)."""
    n = table.num_rows
    return pa.RecordBatch.from_arrays(
        [
            pa.array(["consume"] * n),
            table.column("trajectory_id").combine_chunks(),
            table.column("group_id").combine_chunks(),
            pa.array(np.full(n, learner_step, dtype=np.int64)),
            pa.array(np.full(n, served_version, dtype=np.int64)),
            pa.array(np.asarray(lags, dtype=np.int32)),
            pa.array(np.full(n, time.time())),
        ],
        schema=CONSUMPTION_SCHEMA,
    )


def consumption_history(
    batches: Iterable[pa.RecordBatch], resume_learner_step: int | None = None
) -> dict[str, list[tuple[int, int]]]:
    """Replay consumption records: trajectory_id -> [(learner_step, lag)] of its surviving uses.
    A rollback marker (and `resume_learner_step`) drops uses at later learner steps."""
    history: dict[str, list[tuple[int, int]]] = {}
    for batch in batches:
        cols = batch.to_pydict()
        for op, tid, step, lag in zip(cols["op"], cols["trajectory_id"], cols["learner_step"], cols["lag"]):
            if op == "consume":
                history.setdefault(tid, []).append((step, lag))
            else:
                history = _rollback(history, step)
    if resume_learner_step is not None:
        history = _rollback(history, resume_learner_step)
    return {tid: uses for tid, uses in history.items() if uses}


def consumption_by_step(batches: Iterable[pa.RecordBatch]) -> dict[int, list[tuple[str, int]]]:
    """Replay consumption records: learner_step -> [(trajectory_id, lag)] of its surviving uses, in
    the order they were recorded (the sampled batch's row order). A rollback marker drops the steps
    after its learner_step, so a step trained again after a resume lists the batch it got then."""
    steps: dict[int, list[tuple[str, int]]] = {}
    for batch in batches:
        cols = batch.to_pydict()
        for op, tid, step, lag in zip(cols["op"], cols["trajectory_id"], cols["learner_step"], cols["lag"]):
            if op == "consume":
                steps.setdefault(step, []).append((tid, lag))
            else:
                steps = {s: uses for s, uses in steps.items() if s <= step}
    return steps


def _rollback(history: dict[str, list[tuple[int, int]]], learner_step: int) -> dict[str, list[tuple[int, int]]]:
    return {tid: [u for u in uses if u[0] <= learner_step] for tid, uses in history.items()}
