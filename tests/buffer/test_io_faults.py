"""Log-writer I/O errors (ENOSPC, EIO, torn and short writes, failing fsync) at many points: a failed
write is never acknowledged, never corrupts later frames, and every acknowledged row comes back after
reopening the directory."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.log import LogFailedError
from streamrl.buffer.store import ReplayBuffer
from streamrl.core import iofaults
from streamrl.core.iofaults import Fault, FaultKind, FaultPlan
from tests.buffer.helpers import make_group

NUM_GROUPS = 8


def _cfg(root: Path, **kw) -> BufferConfig:
    return BufferConfig(
        root_dir=str(root),
        batch_size=2,
        group_size=2,
        coalesce_below_rows=1,
        flush_every_rows=10_000,
        flush_every_ms=3_600_000,
        segment_max_bytes=6_000,
        **kw,
    )


def _run(
    root: Path, plan: FaultPlan, *, checkpoint_every: int = 0, sample: bool = False
) -> tuple[list[str], list[str]]:
    """Append groups with durable=True until the buffer fails (the run stops there); returns the
    acknowledged groups and the groups whose consumption was recorded."""
    acked: list[str] = []
    consumed: list[str] = []
    with iofaults.install(plan):
        try:
            buf = ReplayBuffer(_cfg(root))
        except LogFailedError:  # the first segment could not be started: nothing was acknowledged
            return acked, consumed
        try:
            for g in range(NUM_GROUPS):
                buf.append(make_group(f"g{g}", 2, num_response=40), durable=True)
                acked.append(f"g{g}")
                if checkpoint_every and g % checkpoint_every == 0:
                    buf.checkpoint()
                if sample and g % 2 == 1 and (batch := buf.sample(served_version=0, learner_step=g)) is not None:
                    consumed.append(batch.table.column("group_id")[0].as_py())
            buf.close()
        except OSError as e:
            assert isinstance(e, LogFailedError), repr(e)
            fsyncs = plan.calls["traj", "fsync"]
            with pytest.raises(LogFailedError, match="accepts no more writes"):  # sticky: every later call fails
                buf.append(make_group("after", 2), durable=True)
            with pytest.raises(LogFailedError):
                buf.checkpoint()
            with pytest.raises(LogFailedError):
                buf.sample(served_version=0, learner_step=99)
            with pytest.raises(LogFailedError):
                buf.close()  # releases the directory anyway
            assert plan.calls["traj", "fsync"] == fsyncs  # a failed log is never fsynced again
    del buf
    gc.collect()
    return acked, consumed


def _recovered(root: Path) -> tuple[set[str], ReplayBuffer]:
    buf = ReplayBuffer(_cfg(root))
    report = buf.recovery_report
    assert not report.corrupt, report.corrupt  # a failed write may leave a torn tail, never a bad frame
    return {
        gid
        for gid, ok in zip([f"g{g}" for g in range(NUM_GROUPS)], buf.has_groups([f"g{g}" for g in range(NUM_GROUPS)]))
        if ok
    }, buf


def _check(root: Path, acked: list[str], consumed: list[str], plan: FaultPlan) -> None:
    assert plan.injected, "the fault point was never reached"
    recovered, buf = _recovered(root)
    assert set(acked) <= recovered, f"acknowledged but lost: {sorted(set(acked) - recovered)} ({plan.injected})"
    left = []
    step = 100
    while (batch := buf.sample(served_version=0, learner_step=step)) is not None:
        left.append(batch.table.column("group_id")[0].as_py())
        step += 1
    assert not set(consumed) & set(left), "a group whose consumption was recorded came back"
    assert set(acked) - set(consumed) <= set(left)
    buf.close()


@pytest.mark.parametrize("kind", [FaultKind.ENOSPC, FaultKind.EIO, FaultKind.TORN, FaultKind.SHORT])
@pytest.mark.parametrize("at", [0, 1, 2, 3, 6, 9, 12])
def test_write_fault_on_the_trajectory_log(tmp_path, kind, at):
    """Call 0 is the segment header, then frame / index entry pairs; the small segments roll, so
    later points hit the end-of-stream marker and a new segment's header too."""
    plan = FaultPlan((Fault(kind=kind, at=at, log="traj"),))
    acked, consumed = _run(tmp_path, plan)
    if kind is FaultKind.SHORT:
        assert acked == [f"g{g}" for g in range(NUM_GROUPS)]  # a short write is legal: the writer goes on
    _check(tmp_path, acked, consumed, plan)


@pytest.mark.parametrize("kind", [FaultKind.TORN, FaultKind.EIO])
@pytest.mark.parametrize("at", [0, 1, 2, 4])
def test_write_fault_on_the_consumption_log(tmp_path, kind, at):
    """A consumption record that did not reach the log is not recorded: its groups come back."""
    plan = FaultPlan((Fault(kind=kind, at=at, log="consumed"),))
    acked, consumed = _run(tmp_path, plan, sample=True)
    _check(tmp_path, acked, consumed, plan)


@pytest.mark.parametrize("at", [0, 1, 2, 5])
def test_failed_fsync_fails_the_log_for_good(tmp_path, at):
    """fsyncgate: after a failed fsync the dirty pages may be gone; a retried fsync on the same file
    would succeed and claim durability. The writer fails instead and never fsyncs that file again."""
    plan = FaultPlan((Fault(kind=FaultKind.FSYNC_EIO, at=at, log="traj"),))
    acked, consumed = _run(tmp_path, plan, checkpoint_every=1)
    assert len(acked) < NUM_GROUPS
    fsyncs = [line for line in plan.injected if "fsync" in line]
    assert len(fsyncs) == 1
    _check(tmp_path, acked, consumed, plan)


def test_seeded_random_faults_lose_no_acknowledged_row(tmp_path):
    for seed in range(12):
        root = tmp_path / f"s{seed}"
        plan = FaultPlan(seed=seed, rate=0.08, logs=("traj", "consumed"))
        acked, consumed = _run(root, plan, checkpoint_every=3, sample=True)
        if plan.injected:
            _check(root, acked, consumed, plan)


def test_parse_the_environment_spec():
    plan = iofaults.parse("seed=7,rate=0.5,kinds=torn+fsync_eio,logs=traj,max=2,at=consumed:write:3:eio")
    assert plan.rate == 0.5 and plan.kinds == (FaultKind.TORN, FaultKind.FSYNC_EIO) and plan.logs == ("traj",)
    assert plan.faults[("consumed", "write", 3)].kind is FaultKind.EIO and plan.max_faults == 2
    with pytest.raises(ValueError, match="STREAMRL_IO_FAULTS"):
        iofaults.parse("at=traj:fsync:1:torn")


@pytest.mark.parametrize("at", [0, 1, 2, 3])
def test_write_fault_on_the_image_log_stops_the_rows_that_reference_it(tmp_path, at):
    from tests.buffer.test_images import BLUE, GREEN, RED, _image_group

    plan = FaultPlan((Fault(kind=FaultKind.TORN, at=at, log="images"),))
    acked = []
    with iofaults.install(plan):
        buf = ReplayBuffer(_cfg(tmp_path))
        try:
            for gid, blob in (("r", RED), ("g", GREEN), ("b", BLUE)):
                buf.append(_image_group(gid, [[blob]] * 2), images=[blob], durable=True)
                acked.append(gid)
        except LogFailedError:
            assert buf.num_rows_appended == 2 * len(acked)  # the refused rows never entered the buffer
            with pytest.raises(LogFailedError):
                buf.append(make_group("text", 2), durable=True)
        with pytest.raises(LogFailedError):
            buf.close()
    assert plan.injected and len(acked) < 3
    del buf
    gc.collect()
    again = ReplayBuffer(_cfg(tmp_path))
    assert not again.recovery_report.corrupt
    got = []
    while (batch := again.sample(served_version=0, learner_step=len(got) + 1)) is not None:
        assert batch.images is not None and all(batch.images)
        got.append(batch.table.column("group_id")[0].as_py())
    assert got == acked
    again.close()
