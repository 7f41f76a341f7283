"""The I/O-fault chaos family's checkpoint and run-file scenarios, without a real run: every seeded
segment plan parses and arms one hard fault, the plans cover buffer logs, checkpoints and run files,
each checkpoint or driver-state plan lands on the real writer (a tiny train state, `DriverState.save`)
and stops it with an error the family recognises as clear, and the report counts hard faults by
target. `make chaos` / `python -m bench.chaos --families io` run them for real."""

from __future__ import annotations

import traceback
from collections import Counter

import pytest

from bench import chaos_families, chaos_io
from streamrl.core import iofaults
from streamrl.core.atomic import WriteFailedError, unsealed_reason
from streamrl.learner.checkpoint import CheckpointWriteError, save_checkpoint
from streamrl.streaming.pipeline import DriverState
from tests.streaming.test_iofaults_run_files import _train_state


def _hard_fault(spec: str) -> iofaults.Fault:
    plan = iofaults.parse(spec)
    assert len(plan.faults) == 1 and plan.kinds == (iofaults.FaultKind.SHORT,) and plan.rate > 0
    return next(iter(plan.faults.values()))


def _printed(error: BaseException) -> str:
    """The line a segment's traceback ends with (what `CLEAR_ERROR` searches)."""
    return "".join(traceback.format_exception_only(error))


def test_the_io_segments_cover_buffer_logs_checkpoints_and_run_files():
    segments = chaos_io.io_segments(3)
    assert segments == chaos_io.io_segments(3) and segments != chaos_io.io_segments(4)
    faults = [_hard_fault(spec) for spec in segments]
    assert Counter(chaos_io.target(f.log) for f in faults) == Counter(buffer=5, checkpoint=3, run_file=2)
    assert {f.kind.value for f in faults if chaos_io.target(f.log) != "buffer"} == set(chaos_io.HARD_KINDS)
    assert len(chaos_io.io_segments(3, num_segments=4)) == 4


@pytest.mark.parametrize("seed", [0, 1])
def test_each_checkpoint_plan_stops_the_real_checkpoint_writer_clearly(tmp_path, seed):
    """A segment's plan, armed as the learner arms it, breaks the first checkpoint it writes: the
    error is one the family counts as a clear stop, and nothing of the checkpoint is left."""
    specs = [s for s in chaos_io.io_segments(seed) if chaos_io.target(_hard_fault(s).log) == "checkpoint"]
    assert len(specs) == 3
    for i, spec in enumerate(specs):
        plan = iofaults.parse(spec)
        folder = tmp_path / f"step_{i:06d}"
        with iofaults.install(plan), pytest.raises(CheckpointWriteError) as failed:
            save_checkpoint(_train_state(), folder)
        assert any(chaos_io.target(line.split()[0]) == "checkpoint" for line in plan.injected)
        assert chaos_io.stopped_clearly(f"Traceback ...\n{_printed(failed.value)}"), _printed(failed.value)
        assert not folder.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", [0, 1])
def test_each_driver_state_plan_stops_the_driver_state_saves_clearly(tmp_path, seed):
    specs = [s for s in chaos_io.io_segments(seed) if chaos_io.target(_hard_fault(s).log) == "run_file"]
    assert len(specs) == 2
    for spec in specs:
        path = tmp_path / "driver_state.json"
        state = DriverState()
        with iofaults.install(iofaults.parse(spec)), pytest.raises(WriteFailedError) as failed:
            for cursor in range(20):  # the driver saves after every admitted group
                state.cursor = cursor
                state.save(path)
        assert DriverState.load(path).cursor == state.cursor - 1  # the save before it: intact
        assert chaos_io.stopped_clearly(_printed(failed.value)), _printed(failed.value)


def test_hard_faults_are_counted_by_target(tmp_path):
    run_dir = tmp_path / "io-s0"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "driver.log").write_text(
        "WARNING streamrl.core.iofaults: I/O fault injected: write call #0 on log run/driver_state.json: short\n"
        "WARNING streamrl.core.iofaults: I/O fault injected: write call #4 on log run/driver_state.json: eio\n"
    )
    (run_dir / "logs" / "LearnerActor-1.log").write_text(
        "WARNING streamrl.core.iofaults: I/O fault injected: write call #0 on log ckpt/SEALED.json: torn\n"
        "WARNING streamrl.core.iofaults: I/O fault injected: fsync call #0 on log ckpt/hf/model.safetensors: "
        "fsync_eio\n"
    )
    (run_dir / "logs" / "BufferActor-1.log").write_text(
        "WARNING streamrl.core.iofaults: I/O fault injected: write call #3 on log traj: enospc\n"
    )
    counts = chaos_io.injected_faults(run_dir)
    assert counts == Counter(short=1, eio=1, torn=1, fsync_eio=1, enospc=1)
    by_target = chaos_io.hard_faults_by_target(run_dir)
    assert by_target == Counter(checkpoint=2, run_file=1, buffer=1)
    summary = chaos_io.summarize_io(counts, [], by_target)
    assert summary["io_hard_faults"] == 4 and summary["io_short_writes"] == 1
    assert summary["io_hard_faults_by_target"] == {"buffer": 1, "checkpoint": 2, "run_file": 1}
    old = {"name": "io", "io_faults_injected": 3, "io_hard_faults": 2, "io_short_writes": 1}  # before targets
    data = {"fault_families": [{"results": [{"name": "io", **summary}, old]}]}
    kinds = chaos_families.by_kind(data, None, {})
    assert kinds["io_hard_faults"] == 6
    assert kinds["io_hard_faults_by_target"] == {"buffer": 3, "checkpoint": 2, "run_file": 1}


def test_a_sealed_checkpoint_under_the_family_short_writes_is_whole(tmp_path):
    """The family's survivable share: every segment makes half the writes short, checkpoints included."""
    plan = iofaults.parse("seed=5,rate=0.5,kinds=short,max=40")
    with iofaults.install(plan):
        save_checkpoint(_train_state(), tmp_path / "step_000001")
    assert any(line.startswith("ckpt/") for line in plan.injected)
    assert unsealed_reason(tmp_path / "step_000001") is None
