"""The durable log: kill -9 recovery, torn tails, corrupt segments, exactly-once across restarts."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from streamrl.buffer import cli
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import TrajectoryStatus
from tests.buffer.helpers import make_group, make_traj

REPO = Path(__file__).resolve().parents[2]


def _cfg(root: Path, **kw) -> BufferConfig:
    kw.setdefault("batch_size", 2)
    kw.setdefault("group_size", 2)
    return BufferConfig(root_dir=str(root), **kw)


def _run_child(root: Path, *, until: str, extra: list[str]) -> list[str]:
    """Start the writer child, read its lines until `until` says stop, then SIGKILL it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.buffer.writer_child", str(root), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    acked: list[str] = []
    try:
        for line in proc.stdout:
            if line.startswith("ACK "):
                acked.append(line.split()[1])
            if (until == "MIDWRITE" and line.startswith("MIDWRITE")) or (
                until != "MIDWRITE" and len(acked) >= int(until)
            ):
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return acked


def _all_group_ids(buf: ReplayBuffer) -> list[str]:
    out = []
    step = 0
    while (batch := buf.sample(served_version=0, learner_step=step)) is not None:
        out.append(batch.table.column("group_id")[0].as_py())
        step += 1
    return out


@pytest.mark.timeout(60)
def test_kill9_mid_append_recovers_flushed_rows_and_reports_torn_tail(tmp_path, caplog):
    acked = _run_child(tmp_path, until="MIDWRITE", extra=["--tear-at", "6"])
    assert len(acked) == 5  # frames 1..5 acknowledged, the 6th torn in half
    buf = ReplayBuffer(_cfg(tmp_path))
    report = buf.recovery_report
    assert report.num_rows == 10 and not report.corrupt
    assert any("torn tail" in line for line in report.torn_tails)
    assert "torn tail" in caplog.text
    assert _all_group_ids(buf) == acked
    buf.append(make_group("after", 2))  # the writer goes on in a fresh segment
    buf.close()
    assert _all_group_ids(ReplayBuffer(_cfg(tmp_path))) == ["after"]


@pytest.mark.timeout(60)
def test_kill9_at_a_random_point_loses_no_acknowledged_row(tmp_path):
    acked = _run_child(tmp_path, until="40", extra=[])
    buf = ReplayBuffer(_cfg(tmp_path))
    assert not buf.recovery_report.corrupt
    recovered = _all_group_ids(buf)
    assert recovered[: len(acked)] == acked  # everything acknowledged, in order (maybe one more)


def _filled_dir(root: Path, num_groups: int, **kw) -> None:
    buf = ReplayBuffer(_cfg(root, flush_every_rows=2, segment_max_bytes=4096, **kw))
    for g in range(num_groups):
        buf.append(make_group(f"g{g:02d}", 2, num_response=32))
    buf.close()


def test_corrupt_frame_is_skipped_with_a_clear_message(tmp_path, caplog):
    _filled_dir(tmp_path, 12)
    segments = sorted(tmp_path.glob("traj-*.arrow"))
    assert len(segments) >= 3
    data = bytearray(segments[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    segments[1].write_bytes(bytes(data))
    buf = ReplayBuffer(_cfg(tmp_path))
    report = buf.recovery_report
    assert len(report.corrupt) == 1 and "checksum mismatch" in report.corrupt[0]
    assert segments[1].name in report.corrupt[0] and "skipped" in report.corrupt[0]
    assert "checksum mismatch" in caplog.text
    got = _all_group_ids(buf)
    assert len(got) == 11 and got == sorted(got)  # exactly one group (one frame) lost


def test_missing_segment_and_unreadable_manifest_are_reported(tmp_path):
    _filled_dir(tmp_path, 12)
    segments = sorted(tmp_path.glob("traj-*.arrow"))
    segments[0].unlink()
    buf = ReplayBuffer(_cfg(tmp_path))
    assert any("missing" in m for m in buf.recovery_report.missing)
    assert len(_all_group_ids(buf)) < 12
    buf.close()
    (tmp_path / "manifest.json").write_text("{not json")
    buf = ReplayBuffer(_cfg(tmp_path))
    assert any("unreadable" in m for m in buf.recovery_report.corrupt)


def test_exactly_once_across_restarts(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path, reuse=2))
    for g in "abc":
        buf.append(make_group(g, 2))
    first = buf.sample(served_version=0, learner_step=1)
    assert first.table.column("group_id")[0].as_py() == "a"
    del buf, first  # a crash: no close, no checkpoint
    gc.collect()
    buf = ReplayBuffer(_cfg(tmp_path, reuse=2))
    assert buf.recovery_report.num_consumption_records == 2
    uses = _all_group_ids(buf)
    assert sorted(uses) == ["a", "b", "b", "c", "c"]  # a once more (reuse 2), b and c twice
    buf.close()
    assert _all_group_ids(ReplayBuffer(_cfg(tmp_path, reuse=2))) == []


def test_resume_from_older_learner_step_rolls_back_consumption(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    for g in "abc":
        buf.append(make_group(g, 2))
    for step in (1, 2, 3):
        buf.sample(served_version=0, learner_step=step)
    buf.close()
    # the learner crashed after step 3 but its last checkpoint is step 1: b and c come back
    buf = ReplayBuffer(_cfg(tmp_path), resume_learner_step=1)
    assert _all_group_ids(buf) == ["b", "c"]
    buf.close()
    assert _all_group_ids(ReplayBuffer(_cfg(tmp_path))) == []  # the rollback itself was durable


def test_partial_rows_survive_restart_for_resume(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append([make_traj("a", 0, status=TrajectoryStatus.PARTIAL), make_traj("a", 1)])
    buf.checkpoint()
    buf.close()
    buf = ReplayBuffer(_cfg(tmp_path))
    (resumable,) = buf.resumable()
    assert resumable.trajectory_id == "a/0" and resumable.agent_data().trajectory_id == "a/0"
    buf.append([make_traj("a", 0)])
    assert buf.sample(served_version=0, learner_step=1).trajectory_ids == ["a/0", "a/1"]


def test_one_writer_per_directory(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    with pytest.raises(ValueError, match="another writer"):
        ReplayBuffer(_cfg(tmp_path))
    buf.close()
    ReplayBuffer(_cfg(tmp_path)).close()


def test_export_stats_and_frame(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append([make_traj("a", 0, status=TrajectoryStatus.PARTIAL)])
    buf.append(make_group("a", 2, rewards=[0.0, 1.0], version=1) + make_group("b", 2, version=2))
    buf.sample(served_version=3, learner_step=1)
    buf.close()
    out = tmp_path / "export" / "rows.parquet"
    assert cli.export(tmp_path, out) == 5
    table = pq.read_table(out)
    assert table.column("is_latest").to_pylist() == [False, True, True, True, True]
    assert table.column("num_consumed").to_pylist() == [1, 1, 1, 0, 0]
    frame = cli.load_frame(tmp_path)
    assert len(frame) == 5 and frame["last_consume_step"].max() == 1
    assert cli.load_dataset(tmp_path).count_rows() == 5
    text = cli.stats(tmp_path)
    assert "trajectories: 4, groups: 2" in text
    assert "lag at consume (trajectory, oldest token): 0:0 1:0 2:2" in text
    assert "reward (finished): n=4" in text
    assert "versions spanned per trajectory (finished): n=4 mean=0 " in text  # each made at one version
    assert "interruptions per trajectory (finished): n=4 mean=0 " in text


def test_cli_subcommands(tmp_path, capsys):
    import argparse

    _filled_dir(tmp_path / "buf", 2)
    parser = argparse.ArgumentParser(prog="streamrl")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["buffer", "stats", str(tmp_path / "buf")])
    assert args.func(args) == 0 and "rows logged: 4" in capsys.readouterr().out
    args = parser.parse_args(["buffer", "export", str(tmp_path / "buf"), "--parquet", str(tmp_path / "o.parquet")])
    assert args.func(args) == 0 and pq.read_table(tmp_path / "o.parquet").num_rows == 4
    with pytest.raises(ValueError, match="not a buffer directory"):
        cli.stats(tmp_path / "nope")


def test_log_keeps_append_order_when_small_and_large_batches_mix(tmp_path):
    """Small batches are held for coalescing, large ones go to the writer thread at once: the log
    must still replay a partial row before the finished row that supersedes it."""
    cfg = _cfg(tmp_path, batch_size=4, group_size=4, coalesce_below_rows=3, flush_every_rows=1000)
    buf = ReplayBuffer(cfg)
    buf.append([make_traj("a", 0, status=TrajectoryStatus.PARTIAL)])  # held (1 row)
    buf.append([make_traj("a", 0), make_traj("a", 1), make_traj("a", 2)])  # submitted at once
    buf.append([make_traj("a", 3)])  # held, written by flush
    buf.flush()
    del buf  # a crash after the flush: everything flushed must come back, in order
    gc.collect()
    buf = ReplayBuffer(_cfg(tmp_path, batch_size=4, group_size=4))
    assert buf.resumable() == [] and buf.recovery_report.num_rows == 5
    assert buf.sample(served_version=0, learner_step=1).trajectory_ids == ["a/0", "a/1", "a/2", "a/3"]


def test_writer_thread_failure_surfaces_at_the_flush(tmp_path, monkeypatch):
    from streamrl.buffer.log import SegmentWriter

    buf = ReplayBuffer(_cfg(tmp_path, flush_every_rows=4, coalesce_below_rows=1))

    def failing_write(self, batch):
        raise OSError("disk full")

    monkeypatch.setattr(SegmentWriter, "write", failing_write)
    buf.append(make_group("a", 2))  # handed to the writer thread; not acknowledged yet
    with pytest.raises(OSError, match="disk full"):
        buf.append(make_group("b", 2))  # reaches flush_every_rows: waits for the writes


def test_recovering_a_consumed_group_with_a_failed_member(tmp_path):
    """Found by the stateful test: the failed member's row was killed twice on recovery, which
    corrupted the row store's chunk counts and made the resume crash."""
    buf = ReplayBuffer(_cfg(tmp_path, batch_size=3, group_size=3))
    buf.append(make_group("a", 2) + [make_traj("a", 2, status=TrajectoryStatus.FAILED)])
    assert buf.sample(served_version=0, learner_step=1).trajectory_ids == ["a/0", "a/1"]
    buf.close()
    again = ReplayBuffer(_cfg(tmp_path, batch_size=3, group_size=3), resume_learner_step=1)
    assert again.stats()["buffer/live_rows"] == 0 and again.num_ready() == 0
    again.close()
