"""Crash consistency of a run directory, proven the way SQLite and ALICE do it: record a real workload's
file operations, build every state a power loss (or a killed process) could leave, recover each one
with the real recovery code and check what it promised.

    python -m bench.crash_consistency [--states 2000] [--seed 0] [--out bench/results/crash_consistency.json]

The workload (`record_workload`) is the durable part of a short run, in the pipeline's order:
a buffer log (`ReplayBuffer` on `RUN_DIR/buffer`, small segments so they roll) gets groups appended
with `durable=True`, each followed by the admission cursor saved in `driver_state.json`, a batch
sampled per step, and for each step a sealed learner checkpoint folder (`atomic_dir(sync=True)`),
`ReplayBuffer.checkpoint()`, the checkpoint recorded in the `DriverState` (oldest dropped past
`keep_checkpoints=2`), `DriverState.save` and the dropped folder deleted (`Pipeline.settle_checkpoint`).
As with `trainer.async_checkpoint`, a step's checkpoint is written and recorded only after the next
step's admissions and batch; halfway it is settled at once and the buffer is closed and reopened with
`resume_learner_step` (a clean restart), and the run ends with its last checkpoint settled, one more
group and `close()`. Crash states come from `bench.crashsim`. `check_state` recovers a state
as `streamrl train --resume` does and reports each broken promise:

- `driver_state.json` is the state of the last save that returned, or of the one in progress;
- the state's newest checkpoint is complete (its files byte for byte): `use_newest_complete` neither
  resumes a torn checkpoint nor has to fall back from one the saved state names;
- every prompt below the saved admission cursor has its group in the recovered log (I1: a resume
  never skips an admitted prompt whose rows a power loss dropped);
- the buffer recovers without raising and holds every group acknowledged before the crash: after a
  power loss those of a returned `append(durable=True)` (fsynced: `buffer.fsync_durable_appends`),
  `checkpoint()` or `close()`, after a killed process also every flushed one; every group whose
  consumption the resumed checkpoint covers is never handed out again, every other acknowledged
  group is, with its rows intact.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.crashsim import CrashPoint, CrashState, crash_states, write_tree
from bench.crashsim_record import Recorder, Trace
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.schema import batch_to_trajectories
from streamrl.buffer.store import ReplayBuffer
from streamrl.core.atomic import SEAL, atomic_dir, make_dirs
from streamrl.core.run_dir import CHECKPOINT_HF, CHECKPOINT_STATE, Checkpoint, RunDir
from streamrl.rollout.types import FinishReason, Trajectory
from streamrl.streaming.checkpoints import (
    CheckpointRecord,
    delete_checkpoints,
    drop_old_checkpoints,
    record_checkpoint,
    use_newest_complete,
)
from streamrl.streaming.driver_state import DriverState

REPO = Path(__file__).resolve().parents[1]
STEPS = ((1, ("g01", "g02")), (2, ("g03", "g04")), (3, ("g05",)), (4, ("g06", "g07")))
REOPEN_AFTER_STEP = 2
LAST_GROUP = "g08"
# Problems of bugs found by this check and reported, each reproduced by a strict xfail test.
KNOWN_BUGS: dict[str, str] = {}  # pattern -> test


def known_bug(problem: str) -> str | None:
    """The xfail test reproducing the known bug behind `problem`, or None for a new problem."""
    return next((test for pattern, test in KNOWN_BUGS.items() if re.search(pattern, problem)), None)


def trajectories(group_id: str) -> list[Trajectory]:
    """Two finished rows whose tokens and rewards are derived from `group_id` (checked after recovery)."""
    base = int(group_id[1:]) * 1000
    return [
        Trajectory(
            trajectory_id=f"{group_id}/{i}",
            group_id=group_id,
            sample_index=i,
            agent_name="crash",
            prompt_ids=[base + j for j in range(5)],
            response_ids=[base + 500 + i * 50 + j for j in range(40)],
            response_mask=[1] * 40,
            behavior_logprobs=[-0.5] * 40,
            policy_versions=[0] * 40,
            reward=float(i),
            finish_reason=FinishReason.STOP,
        )
        for i in range(2)
    ]


def checkpoint_files(step: int) -> dict[str, bytes]:
    """The files of the learner checkpoint of `step` (stand-ins for weights, optimizer and state)."""
    return {
        f"{CHECKPOINT_HF}/model.safetensors": bytes((step * 7 + i) % 251 for i in range(3000)),
        "optimizer.pt": bytes((step * 13 + i) % 241 for i in range(1500)),
        CHECKPOINT_STATE: json.dumps({"policy_version": step}).encode(),
    }


def _write_checkpoint(step: int) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        for name, data in checkpoint_files(step).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)

    return write


# Two groups per trajectory segment: a segment's header is ~2.5 KB and one group's frame ~4 KB, so a
# segment rolls once its second group is written. A segment that rolled after every group would seal
# (fsync) each durable append whatever `fsync_durable_appends` says, and the check of that protocol
# would see nothing to catch.
SEGMENT_MAX_BYTES = 8000


def buffer_config(run: Path, *, fsync: bool = True, fsync_durable: bool = True) -> BufferConfig:
    return BufferConfig(
        root_dir=str(RunDir(run).buffer),
        batch_size=2,
        group_size=2,
        flush_every_rows=10_000,
        flush_every_ms=1e9,
        segment_max_bytes=SEGMENT_MAX_BYTES,
        fsync_on_checkpoint=fsync,
        fsync_durable_appends=fsync_durable,
    )


@dataclass(kw_only=True, slots=True)
class Workload:
    """What the recorded run does; the defaults are the real code, tests swap in broken variants."""

    save_state: Callable[[DriverState, Path], None] = DriverState.save
    seal_checkpoints: bool = True
    fsync_buffer: bool = True
    fsync_durable_appends: bool = True
    # trainer.async_checkpoint: a step's checkpoint folder is written and recorded after the next
    # step's admissions and batch (the latest a background write can land), not before them
    async_checkpoint: bool = True


def record_workload(root: Path, workload: Workload | None = None) -> Trace:
    """Run the workload (module doc) in `root/run` under a recorder; marks name what was acknowledged."""
    workload = workload or Workload()
    run = root / "run"
    run.mkdir(parents=True)
    state_path = RunDir(run).driver_state
    with Recorder(root) as rec:
        cfg = buffer_config(run, fsync=workload.fsync_buffer, fsync_durable=workload.fsync_durable_appends)
        buf = ReplayBuffer(cfg)
        state, appended = DriverState(), []
        in_flight: CheckpointRecord | None = None  # snapshot taken, folder not yet written (async_checkpoint)
        _save(rec, workload, state, state_path)
        for step, groups in STEPS:
            for gid in groups:  # admission: the group's rows durably, then the cursor (Pipeline.admit_next_group)
                buf.append(trajectories(gid), durable=True)
                appended.append(gid)
                rec.mark("flushed", gid)
                if workload.fsync_durable_appends:  # a durable append is fsynced: it survives a power loss
                    rec.mark("synced", [gid])
                state.cursor = len(appended)
                _save(rec, workload, state, state_path)
            batch = buf.sample(served_version=0, learner_step=step)
            rec.mark("consumed", (step, sorted(set(batch.table.column("group_id").to_pylist()))))
            if in_flight is not None:  # the previous step's checkpoint, written while this step trained
                _settle(rec, workload, buf, state, in_flight, appended, state_path)
            step_dir = RunDir(run).checkpoint(step)
            make_dirs(step_dir.parent, sync=True)  # as Pipeline.checkpoint does
            state.learner_step = state.policy_version = step
            in_flight = CheckpointRecord.at(state, step_dir)
            if not workload.async_checkpoint or step == REOPEN_AFTER_STEP:  # a clean restart waits for it
                _settle(rec, workload, buf, state, in_flight, appended, state_path)
                in_flight = None
            if step == REOPEN_AFTER_STEP:
                buf.close()
                buf = ReplayBuffer(cfg, resume_learner_step=step)
        if in_flight is not None:  # the run ends once its last checkpoint is recorded
            _settle(rec, workload, buf, state, in_flight, appended, state_path)
        buf.append(trajectories(LAST_GROUP), durable=True)
        rec.mark("flushed", LAST_GROUP)
        if workload.fsync_durable_appends:
            rec.mark("synced", [LAST_GROUP])
        state.cursor += 1
        _save(rec, workload, state, state_path)
        buf.close()
        rec.mark("synced", appended + [LAST_GROUP])
    return rec.trace


def _settle(
    rec: Recorder,
    workload: Workload,
    buf: ReplayBuffer,
    state: DriverState,
    record: CheckpointRecord,
    appended: list[str],
    state_path: Path,
) -> None:
    """The learner's write of `record`'s folder, then `Pipeline.settle_checkpoint`'s order: the buffer
    made durable, the record, the state saved, the dropped folder deleted."""
    atomic_dir(Path(record.path), _write_checkpoint(record.step), sync=workload.seal_checkpoints)
    buf.checkpoint()
    rec.mark("synced", list(appended))
    record_checkpoint(state, record)
    dropped = drop_old_checkpoints(state, 2)
    _save(rec, workload, state, state_path)
    delete_checkpoints(dropped)


def _save(rec: Recorder, workload: Workload, state: DriverState, path: Path) -> None:
    rec.mark("saving", _canonical(state))
    workload.save_state(state, path)
    rec.mark("saved", _canonical(state))


def _canonical(state: DriverState) -> str:
    return json.dumps(asdict(state) | {"elapsed_s": 0.0}, sort_keys=True)


@dataclass(kw_only=True, slots=True)
class _Acked:
    """What the workload had acknowledged at one crash point."""

    flushed: set[str] = field(default_factory=set)
    synced: set[str] = field(default_factory=set)
    consumed: dict[int, list[str]] = field(default_factory=dict)  # learner step -> groups
    states: set[str | None] = field(default_factory=set)  # driver states the file may hold

    @classmethod
    def at(cls, trace: Trace, at: int) -> _Acked:
        acked, saved, saving = cls(), None, None
        for mark in (m for m in trace.marks if m.at <= at):
            if mark.name == "flushed":
                acked.flushed.add(mark.value)
            elif mark.name == "synced":
                acked.synced.update(mark.value)
            elif mark.name == "consumed":
                acked.consumed[mark.value[0]] = mark.value[1]
            elif mark.name == "saving":
                saving = mark.value
            elif mark.name == "saved":
                saved, saving = mark.value, None
        acked.states = {saved} | ({saving} if saving is not None else set())
        return acked


def check_state(root: Path, state: CrashState, trace: Trace) -> list[str]:
    """Write the crash state to `root`, recover it, and list every broken promise at each of its points."""
    write_tree(root, state.tree)
    run = root / "run"
    problems: list[str] = []
    path = RunDir(run).driver_state
    try:
        driver = DriverState.load(path) if path.exists() else None
    except (ValueError, TypeError) as e:
        return [f"{path.name} does not load: {e!r}"]
    found = _canonical(driver) if driver is not None else None
    driver = driver or DriverState()
    named = driver.checkpoint
    use_newest_complete(driver)
    if driver.checkpoint != named:
        lost = "whose parent folder is not on disk" if not Path(named).parent.is_dir() else "which is not complete"
        problems.append(f"the saved state names checkpoint {named}, {lost}: fell back to {driver.checkpoint}")
    if driver.checkpoint is not None:
        problems += _check_checkpoint(Path(driver.checkpoint), driver.checkpoint_step)
    groups, recovery_problems = _recover_buffer(run, driver.checkpoint_step)
    problems += recovery_problems
    if groups is not None:  # I1: every prompt below the saved cursor is in the log (admitted once, never lost)
        admitted = [gid for _, step_groups in STEPS for gid in step_groups] + [LAST_GROUP]
        lost = [gid for gid in admitted[: driver.cursor] if gid not in groups]
        if lost:
            problems.append(f"the saved cursor {driver.cursor} is past admitted groups the log lost: {lost}")
    for point in state.points:
        acked = _Acked.at(trace, point.at)
        if found not in acked.states:
            problems.append(f"{_where(point, trace)}: {path.name} holds neither the old nor the new state")
        if groups is not None:
            problems += [
                f"{_where(point, trace)}: {p}" for p in _check_groups(groups, acked, point, driver.checkpoint_step)
            ]
    return problems


def _where(point: CrashPoint, trace: Trace) -> str:
    last = trace.ops[point.at - 1] if point.at else None
    what = f"{last.kind.value} {last.path or f'inode {last.ino}'}" if last else "none"
    return f"crash after op {point.at} ({what}), {point.label}"


def _check_checkpoint(folder: Path, step: int) -> list[str]:
    want = checkpoint_files(Checkpoint.at(folder).step)
    got = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != SEAL}
    if got != want:
        return [
            f"resumed checkpoint {folder.name} (step {step}) is torn: files {sorted(got)} differ from {sorted(want)}"
        ]
    return []


def _recover_buffer(run: Path, resume_step: int) -> tuple[dict[str, list[Trajectory]] | None, list[str]]:
    """Groups the recovered buffer hands out (every ready batch) and problems; None if recovery raised."""
    try:
        buf = ReplayBuffer(buffer_config(run), resume_learner_step=resume_step)
    except Exception as e:  # noqa: BLE001 (any exception is the finding)
        return None, [f"buffer recovery raised {e!r}"]
    try:
        known = {gid for _, groups in STEPS for gid in groups} | {LAST_GROUP}
        present = {gid for gid, has in zip(sorted(known), buf.has_groups(sorted(known))) if has}
        handed: dict[str, list[Trajectory]] = {gid: [] for gid in present}
        step = resume_step
        while (batch := buf.sample(served_version=0, learner_step=step + 1)) is not None:
            step += 1
            for traj in batch_to_trajectories(batch.table):
                handed.setdefault(traj.group_id, []).append(traj)
        return handed, []
    finally:
        buf.close()


def _check_groups(handed: dict[str, list[Trajectory]], acked: _Acked, point: CrashPoint, resume_step: int) -> list[str]:
    durable = acked.synced | (acked.flushed if point.process_kill else set())
    kept_uses = {gid for step, groups in acked.consumed.items() if step <= resume_step for gid in groups}
    problems = [f"acknowledged group {gid} was not recovered" for gid in sorted(durable - handed.keys())]
    for gid, rows in sorted(handed.items()):
        if rows and gid in kept_uses:
            problems.append(f"group {gid}, consumed at or before the resumed step {resume_step}, was handed out again")
        elif not rows and gid in durable and gid not in kept_uses:
            problems.append(f"acknowledged group {gid} is recovered but never handed out")
        elif rows and sorted((t.trajectory_id, t.response_ids, t.reward) for t in rows) != sorted(
            (t.trajectory_id, t.response_ids, t.reward) for t in trajectories(gid)
        ):
            problems.append(f"group {gid} came back with different rows")
    return problems


@dataclass(kw_only=True, slots=True)
class Result:
    num_ops: int
    num_marks: int
    num_states_found: int
    num_states_checked: int
    num_crash_points_checked: int  # (state, crash point) pairs: a state stands for every point that can leave it
    num_process_kill_states: int
    problems: list[str]
    seconds: float


def run(
    *,
    max_states: int,
    seed: int = 0,
    workload: Workload | None = None,
    work_dir: Path | None = None,
    num_random: int = 6,
    num_torn: int = 2,
) -> Result:
    """Record the workload, build at most `max_states` crash states (`bench.crashsim.crash_states`:
    `num_random` random and `num_torn` torn choices per crash point), check them all. Recovery's
    warnings about the torn logs it meets are silenced meanwhile (thousands of them)."""
    started = time.monotonic()
    base = work_dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="crashsim-", dir=base) as tmp:
            root = Path(tmp) / "root"
            root.mkdir()
            trace = record_workload(root, workload)
            states, found = crash_states(
                trace, max_states=max_states, seed=seed, num_random=num_random, num_torn=num_torn
            )
            problems = []
            for state in states:
                problems += check_state(root, state, trace)
    finally:
        logging.disable(previous)
    return Result(
        num_ops=len(trace.ops),
        num_marks=len(trace.marks),
        num_states_found=found,
        num_states_checked=len(states),
        num_crash_points_checked=sum(len(s.points) for s in states),
        num_process_kill_states=sum(any(p.process_kill for p in s.points) for s in states),
        problems=problems,
        seconds=time.monotonic() - started,
    )


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--states", type=int, default=2000, help="most crash states to check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--random-per-point", type=int, default=16, help="random subsets of pending operations per crash point"
    )
    parser.add_argument("--torn-per-point", type=int, default=4, help="torn writes per crash point")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "crash_consistency.json")
    args = parser.parse_args(argv)
    result = run(max_states=args.states, seed=args.seed, num_random=args.random_per_point, num_torn=args.torn_per_point)
    command = "python -m bench.crash_consistency " + " ".join(argv if argv is not None else sys.argv[1:])
    new = [p for p in result.problems if known_bug(p) is None]
    by_bug: dict[str, int] = {}
    for p in result.problems:
        if (test := known_bug(p)) is not None:
            by_bug[test] = by_bug.get(test, 0) + 1
    report = {
        "command": command.strip(),
        "machine": machine(),
        **asdict(result) | {"problems": None},
        "num_problems": len(result.problems),
        "num_new_problems": len(new),
        "known_bugs": by_bug,
        "new_problems": new[:50],
        "known_bug_examples": [p for p in result.problems if known_bug(p)][:5],
    }
    report.pop("problems")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "problems"}, indent=2))
    return 1 if new else 0


if __name__ == "__main__":
    raise SystemExit(main())
