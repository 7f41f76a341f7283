"""The run's learner checkpoints: which ones it keeps, and which one a resume starts from.

`Pipeline.checkpoint` has the learner snapshot its state for `RUN_DIR/checkpoints/step_NNNNNN`; the
learner writes and seals it (`learner.checkpoint`), on a background thread with
`trainer.async_checkpoint` (the default) while it trains the next steps. `Pipeline.settle_checkpoint`,
after a later step or at the end of the run, waits for the seal, makes the buffer durable, then
records the checkpoint in `DriverState.checkpoints` (oldest first, each with the step and version
label it was taken at) and points the state's `checkpoint*` fields at it. Nothing is recorded before
the folder is sealed, so a crash during the write leaves the records naming the older complete
checkpoints only (the unsealed temporary folder is never read), and a failed write stops the run as
below. The state is saved before anything is deleted: the oldest records past
`trainer.keep_checkpoints` leave the state first, their folders after, so a crash
in between leaves at worst a folder nobody references, never a reference to a deleted folder.

A resume starts from the newest recorded checkpoint that is complete (`core.run_dir.why_incomplete`,
the one rule every reader uses: its seal is there and every file at its size). A torn newer one (a
lost machine, a damaged disk) is skipped: the state then points at the older checkpoint's step and
version offset, and since the buffer rolls its consumption back to the state's `checkpoint_step`,
the learner's weights, the labels and the buffer stay consistent. With no complete checkpoint the
run restarts from the initial model (step 0).

I/O failures (ENOSPC, EIO, a torn write, a failing fsync: real, or injected by `core.iofaults` at
seeded points) stop the run with a clear error and lose nothing a resume needs:
- a checkpoint write that fails raises `learner.checkpoint.CheckpointWriteError` (errno and file):
  nothing is sealed or renamed into place, and it is never recorded (recording comes after the save
  returns), so the saved state names only complete checkpoints and `--resume` starts from the newest;
- a `driver_state.json` save that fails raises `core.atomic.WriteFailedError` (errno and file) and
  leaves the previous file intact (write, fsync, then rename): `--resume` loads it. Its cursor may lag
  the buffer log, which is the truth for rows: `Pipeline.reconcile_cursor` skips the prompts whose rows
  are durable, and the buffer rolls consumption back to the state's `checkpoint_step`, so no
  acknowledged row is lost or admitted twice. A failure of that save inside `Pipeline.checkpoint` (after
  the record, before the deletes) deletes no old checkpoint: deletes wait for a save that returned.
The other run files (`run_info.json`, `accounting.json`, `placement.json`, ...) fail the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.core.run_dir import why_incomplete

if TYPE_CHECKING:
    from streamrl.streaming.driver_state import DriverState

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class CheckpointRecord:
    """One complete checkpoint of the run, and the driver facts a resume from it needs."""

    path: str
    step: int  # learner_step of its weights
    policy_version: int  # the version label the engines served when it was taken
    version_offset: int  # its weights' label - step

    @classmethod
    def at(cls, state: DriverState, path: Path) -> CheckpointRecord:
        """The checkpoint at `path` of the state's current step and served version."""
        return cls(
            path=str(path),
            step=state.learner_step,
            policy_version=state.policy_version,
            version_offset=state.version_offset,
        )


def record_checkpoint(state: DriverState, record: CheckpointRecord) -> None:
    """The checkpoint of `record` (written and sealed; its step may be behind the state's, the
    learner having trained on while it was written) is the newest one."""
    state.checkpoints = [r for r in state.checkpoints if r.path != record.path] + [record]
    _point_at(state, record)


def drop_old_checkpoints(state: DriverState, keep: int) -> list[Path]:
    """Forget all but the newest `keep` checkpoints (0: keep all); returns the folders to delete once
    the state is saved (`delete_checkpoints`)."""
    if keep == 0 or len(state.checkpoints) <= keep:
        return []
    dropped, state.checkpoints = state.checkpoints[:-keep], state.checkpoints[-keep:]
    return [Path(r.path) for r in dropped]


def delete_checkpoints(folders: list[Path]) -> None:
    """Delete checkpoint folders: renamed aside first, so a crash mid-delete leaves no half folder
    under a checkpoint's name."""
    for folder in folders:
        if not folder.exists():
            continue
        doomed = folder.with_name(f".{folder.name}.deleting-{os.getpid()}")
        os.replace(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        logger.info("deleted old checkpoint %s", folder)


def use_newest_complete(state: DriverState) -> None:
    """Point the state at the newest complete recorded checkpoint (module doc); a state written
    before checkpoints were recorded has its one checkpoint pointer as the only record."""
    records = state.checkpoints
    if not records and state.checkpoint is not None:
        records = [
            CheckpointRecord(
                path=state.checkpoint,
                step=state.checkpoint_step,
                policy_version=state.checkpoint_policy_version,
                version_offset=state.checkpoint_version_offset,
            )
        ]
    while records:
        why = why_incomplete(Path(records[-1].path))
        if why is None:
            break
        logger.error("checkpoint %s is not complete (%s): falling back to an older one", records[-1].path, why)
        records = records[:-1]
    state.checkpoints = records
    if records:
        _point_at(state, records[-1])
        return
    if state.checkpoint is not None:
        logger.error("no complete checkpoint is left: the run restarts from the initial model (learner step 0)")
    state.checkpoint, state.checkpoint_step, state.checkpoint_policy_version, state.checkpoint_version_offset = (
        None,
        0,
        0,
        0,
    )


def _point_at(state: DriverState, record: CheckpointRecord) -> None:
    state.checkpoint = record.path
    state.checkpoint_step = record.step
    state.checkpoint_policy_version = record.policy_version
    state.checkpoint_version_offset = record.version_offset
