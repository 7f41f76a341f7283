"""Crash consistency, ALICE / CrashMonkey style: a real run directory's file operations are recorded
(`bench.crashsim_record`), every state a power loss or a killed process could leave is built
(`bench.crashsim`), and each one is recovered with the real code and checked (`bench.crash_consistency`):
acknowledged rows survive, no torn checkpoint is resumed, the driver state is the old or the new one.

`make test` checks a bounded sample (`STREAMRL_CRASH_STATES`, default 500); the bench checks them all
(`python -m bench.crash_consistency --states 2000`, bench/results/crash_consistency.json). The broken
protocols below prove the check has teeth: each variant must be caught.
"""

from __future__ import annotations

import builtins
import io
import json
import os
from dataclasses import asdict

import pytest

from bench.crash_consistency import SEGMENT_MAX_BYTES, Workload, buffer_config, known_bug, run, trajectories
from bench.crashsim import FsModel, crash_states
from bench.crashsim_record import OpKind, Recorder
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.core.atomic import atomic_dir, atomic_write
from tests.buffer.helpers import make_group

NUM_STATES = int(os.environ.get("STREAMRL_CRASH_STATES", "500"))


def test_the_recorder_sees_the_system_calls_of_file_objects_and_os_calls(tmp_path):
    (tmp_path / "old").write_text("x")
    with Recorder(tmp_path) as rec:
        atomic_write(tmp_path / "state.json", '{"a": 1}', sync=True)
        with open(tmp_path / "log", "a+") as f:
            f.write("12345")
            f.flush()
            f.truncate(2)
        os.replace(tmp_path / "old", tmp_path / "new")
        (tmp_path / "elsewhere").mkdir()
        rec.mark("done")
    kinds = [op.kind for op in rec.trace.ops]
    assert kinds == [
        OpKind.CREATE,
        OpKind.WRITE,
        OpKind.FSYNC,
        OpKind.RENAME,
        OpKind.FSYNC,  # atomic_write
        OpKind.CREATE,
        OpKind.WRITE,
        OpKind.TRUNCATE,
        OpKind.RENAME,
        OpKind.MKDIR,
    ]
    write = rec.trace.ops[1]
    assert write.data == b'{"a": 1}' and write.offset == 0
    assert rec.trace.ops[4].ino == rec.trace.root_ino  # the folder fsync after the rename
    assert rec.trace.ops[6].data == b"12345" and rec.trace.ops[7].size == 2
    assert rec.trace.initial == {"old": (rec.trace.initial["old"][0], b"x")}
    assert rec.trace.marks[-1].at == len(rec.trace.ops)
    assert "crashsim" not in f"{io.open.__module__} {builtins.open.__module__} {os.write.__module__}"  # restored


def test_a_power_loss_keeps_what_was_fsynced_and_a_kill_keeps_everything(tmp_path):
    with Recorder(tmp_path) as rec:
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"durable")
        os.fsync(fd)
        os.write(fd, b"-pending")
        os.close(fd)
    trace = rec.trace
    model = FsModel(trace)
    for op in trace.ops:
        model.apply(op)
    assert model.tree(set()) == {}  # the folder entry of f was never fsynced
    everything = {seq for seq, _ in model.pending()}
    assert model.tree(everything) == {"f": b"durable-pending"}
    states, found = crash_states(trace, max_states=1000)
    trees = [s.tree for s in states]
    assert {"f": b"durable"} in trees and {"f": b""} in trees
    torn = [
        t
        for t in trees
        if "f" in t and t["f"].startswith(b"durable") and 7 < len(t["f"]) and t["f"] != b"durable-pending"
    ]
    assert torn, "a torn version of the unsynced write"
    assert len(states) == found


@pytest.fixture(scope="module")
def crash_result():
    return run(max_states=NUM_STATES)


@pytest.mark.timeout(120)
def test_every_crash_state_recovers_every_acknowledged_row_and_a_whole_checkpoint(crash_result):
    result = crash_result
    assert result.num_states_checked >= min(NUM_STATES, result.num_states_found)
    assert result.num_states_checked >= 300 or NUM_STATES < 300
    assert result.num_process_kill_states > 20  # killed-process states are checked too
    new = [p for p in result.problems if known_bug(p) is None]
    assert new == [], f"{len(new)} broken promises, e.g. {new[:3]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "broken, expected",
    [
        ("driver state renamed in unsynced", "driver_state.json"),
        ("buffer checkpoint without fsync", "was handed out again"),
        ("checkpoint folder not sealed", "which is not complete"),
        ("durable appends only flushed", "past admitted groups the log lost"),
    ],
)
def test_the_check_catches_broken_durability_protocols(broken, expected):
    def unsynced_save(state, path):
        atomic_write(path, json.dumps(asdict(state)), sync=False)

    workload = {
        "driver state renamed in unsynced": Workload(save_state=unsynced_save),
        "buffer checkpoint without fsync": Workload(fsync_buffer=False),
        "checkpoint folder not sealed": Workload(seal_checkpoints=False),
        "durable appends only flushed": Workload(fsync_durable_appends=False),
    }[broken]
    result = run(max_states=150, workload=workload)
    assert any(expected in p for p in result.problems), result.problems[:5]


def test_the_workload_s_segments_hold_two_groups(tmp_path):
    """The workload's premise (bench.crash_consistency.SEGMENT_MAX_BYTES): a segment that sealed after
    every group would fsync each durable append, and the broken protocol above would go unseen."""
    (tmp_path / "run").mkdir()
    buf = ReplayBuffer(buffer_config(tmp_path / "run").model_copy(update={"segment_max_bytes": 1 << 30}))
    sizes = []
    for gid in ("g01", "g02"):
        buf.append(trajectories(gid), durable=True)
        sizes.append((tmp_path / "run" / "buffer" / "traj-000001.arrow").stat().st_size)
    buf.close()
    assert sizes[0] < SEGMENT_MAX_BYTES <= sizes[1], f"segment bytes after one and two groups: {sizes}"


def test_buffer_reopens_a_directory_with_an_orphaned_index_file(tmp_path):
    cfg = BufferConfig(root_dir=str(tmp_path), batch_size=2, group_size=2)
    buf = ReplayBuffer(cfg)
    buf.append(make_group("a", 2))
    buf.close()
    buf = ReplayBuffer(cfg)  # a second process: its rows go to traj-000002
    buf.append(make_group("b", 2), durable=True)
    buf.close()
    (tmp_path / "traj-000002.arrow").unlink()  # its .idx stays
    buf = ReplayBuffer(cfg)  # must recover (reporting the lost segment), not raise
    assert buf.has_groups(["a", "b"]) == [True, False]
    assert buf.recovery_report.missing
    buf.close()


def test_atomic_dir_makes_the_folder_it_creates_for_it_durable(tmp_path):
    with Recorder(tmp_path) as rec:
        atomic_dir(tmp_path / "checkpoints" / "step_000001", lambda d: (d / "w").write_bytes(b"weights"), sync=True)
    model = FsModel(rec.trace)
    for op in rec.trace.ops:
        model.apply(op)
    on_disk_after_power_loss = model.tree(set())
    assert on_disk_after_power_loss.get("checkpoints/step_000001/w") == b"weights"
