"""Images in the buffer: the write-once image log, image columns through sampling and padding,
recovery (reopen, torn image segment, a schema "1" log), refused appends, text-only runs unchanged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pytest
from PIL import Image

from streamrl.buffer.cli import read_dir
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.images import IMAGE_SCHEMA, IMAGES_PREFIX
from streamrl.buffer.log import SegmentWriter, read_segments, segment_paths
from streamrl.buffer.manifest import MANIFEST, TRAJ_PREFIX
from streamrl.buffer.schema import (
    IMAGE_FIELD_NAMES,
    TRAJECTORY_SCHEMA_V1,
    normalize_batch,
    trajectories_to_batch,
)
from streamrl.buffer.store import ReplayBuffer
from streamrl.buffer.types import ImageBlob, RecoveryReport
from streamrl.models.images import encode_png
from streamrl.rollout.images import ImageStore
from streamrl.rollout.types import Trajectory
from tests.buffer.helpers import make_group, make_traj

pytestmark = pytest.mark.timeout(30)


def _cfg(root: Path | None, **kw) -> BufferConfig:
    kw.setdefault("batch_size", 4)
    kw.setdefault("group_size", 4)
    return BufferConfig(root_dir=None if root is None else str(root), **kw)


def _blob(color: tuple[int, int, int], size: tuple[int, int] = (8, 6)) -> ImageBlob:
    data = encode_png(Image.new("RGB", size, color))
    ref = ImageStore().put(data)
    return ImageBlob.from_ref(ref, data)


RED, GREEN, BLUE = _blob((255, 0, 0)), _blob((0, 255, 0), (5, 9)), _blob((0, 0, 255))


def _with_images(t: Trajectory, refs: list[ImageBlob], tokens: int = 4) -> Trajectory:
    return dataclasses.replace(t, image_refs=[b.sha256 for b in refs], num_image_tokens=[tokens] * len(refs))


def _image_group(group_id: str, per_row: list[list[ImageBlob]]) -> list[Trajectory]:
    return [_with_images(t, refs) for t, refs in zip(make_group(group_id, len(per_row)), per_row)]


def _stored_hashes(root: Path) -> list[str]:
    report = RecoveryReport()
    return [
        sha
        for _, b in read_segments(root, prefix=IMAGES_PREFIX, schema=IMAGE_SCHEMA, report=report)
        for sha in b.column("sha256").to_pylist()
    ]


def _crash(buf: ReplayBuffer) -> None:
    """What a kill -9 leaves: flushed frames, no sealed segments, no final manifest; lock gone."""
    buf.flush()
    buf._dir.release()


def test_images_round_trip_append_sample_padded_one_copy_per_hash(tmp_path):
    rows = [[RED], [RED], [RED, GREEN], [GREEN, RED]]  # one image prompt, two rows add a tool image
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append(_image_group("g", rows), images=[RED, GREEN, RED])  # a duplicate blob is harmless
    sampled = buf.sample(served_version=0, learner_step=1)
    expected = [[b.data for b in row] for row in rows]
    assert sampled.images == expected
    padded = sampled.to_padded()
    assert padded.images == expected  # bytes equal, placeholder order kept, [B][num_images]
    assert sampled.table.column("num_image_tokens").to_pylist() == [[4], [4], [4, 4], [4, 4]]
    assert sampled.table.column("image_refs").to_pylist() == [[b.sha256 for b in row] for row in rows]
    # a later group of the same image prompt supplies it again: still one stored copy
    buf.append(_image_group("h", [[RED]] * 4), images=[RED])
    buf.close()
    assert sorted(_stored_hashes(tmp_path)) == sorted([RED.sha256, GREEN.sha256])
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["schema_version"] == "5" and [s["num_frames"] for s in manifest["segments"][IMAGES_PREFIX]] == [1]


def test_memory_only_buffer_serves_images_and_mixed_batches(tmp_path):
    buf = ReplayBuffer(_cfg(None))
    group = _image_group("g", [[BLUE], [], [], [BLUE, BLUE]])  # text rows in an image batch
    buf.append(group, images=[BLUE])
    padded = buf.sample(served_version=0, learner_step=1).to_padded()
    assert padded.images == [[BLUE.data], [], [], [BLUE.data, BLUE.data]]


def test_reopen_after_crash_finds_images(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append(_image_group("g", [[RED, GREEN]] * 4), images=[RED, GREEN])
    buf.append(_image_group("h", [[BLUE]] * 4), images=[BLUE])
    assert buf.sample(served_version=0, learner_step=1).table.column("group_id")[0].as_py() == "g"
    _crash(buf)
    again = ReplayBuffer(_cfg(tmp_path))
    report = again.recovery_report
    assert report.clean and report.num_images == 3, report.lines()
    sampled = again.sample(served_version=0, learner_step=2)
    assert sampled.table.column("group_id").to_pylist() == ["h"] * 4  # "g" stays consumed
    assert sampled.to_padded().images == [[BLUE.data]] * 4
    assert again.get_image(RED.sha256) == RED.data
    # write-once across processes: the recovered hash set is used, nothing is written again
    again.append(_image_group("k", [[RED]] * 4), images=[RED])
    again.close()
    assert sorted(_stored_hashes(tmp_path)) == sorted([RED.sha256, GREEN.sha256, BLUE.sha256])


def test_torn_last_image_segment_recovers_like_other_logs(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append(_image_group("g", [[RED]] * 4), images=[RED])
    buf.append([], images=[GREEN])  # a second frame, referenced by nothing yet
    _crash(buf)
    ((_, path),) = segment_paths(tmp_path, IMAGES_PREFIX)
    path.write_bytes(path.read_bytes()[:-40])  # the process died while writing GREEN's frame
    again = ReplayBuffer(_cfg(tmp_path))
    report = again.recovery_report
    assert report.num_images == 1 and not report.corrupt
    assert [line for line in report.torn_tails if path.name in line and "indexed but only" in line], report.lines()
    assert report.missing == [f"segment {path.name}: manifest lists 2 frames, 1 recovered"]
    assert again.sample(served_version=0, learner_step=1).to_padded().images == [[RED.data]] * 4
    with pytest.raises(ValueError, match="neither in the buffer nor supplied"):
        again.append(_image_group("h", [[GREEN]] * 4))  # the torn image is really gone
    again.append(_image_group("h", [[GREEN]] * 4), images=[GREEN])  # resupplied: a fresh segment
    again.close()
    third = ReplayBuffer(_cfg(tmp_path))
    assert third.sample(served_version=0, learner_step=2).to_padded().images == [[GREEN.data]] * 4
    assert any(path.name in line for line in third.recovery_report.torn_tails)  # the old tail stays reported
    third.close()


def test_refused_append_with_unknown_image_keeps_previous_content(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append(_image_group("g", [[RED]] * 4), images=[RED])
    before = (buf.num_rows_appended, buf.num_changes, buf.num_ready())
    with pytest.raises(ValueError, match=rf"neither in the buffer nor supplied \(first {BLUE.sha256}"):
        buf.append(_image_group("h", [[RED, BLUE]] * 4), images=[GREEN])  # GREEN is not the missing one
    bad = ImageBlob(sha256=BLUE.sha256, mime="image/png", width=8, height=6, data=RED.data)
    with pytest.raises(ValueError, match="hash to"):
        buf.append(_image_group("h", [[BLUE]] * 4), images=[bad])
    assert (buf.num_rows_appended, buf.num_changes, buf.num_ready()) == before
    assert BLUE.sha256 not in buf._images and GREEN.sha256 not in buf._images  # nothing half-written
    _crash(buf)
    again = ReplayBuffer(_cfg(tmp_path))
    assert again.recovery_report.clean and again.recovery_report.num_rows == 4
    sampled = again.sample(served_version=0, learner_step=1)
    assert sampled.table.column("group_id").to_pylist() == ["g"] * 4
    assert sampled.to_padded().images == [[RED.data]] * 4
    assert again.sample(served_version=0, learner_step=2) is None
    again.close()


def test_image_columns_are_validated():
    t = make_traj("g", 0)
    with pytest.raises(ValueError, match="differ in length"):
        trajectories_to_batch([dataclasses.replace(t, image_refs=[RED.sha256], num_image_tokens=[])])
    with pytest.raises(ValueError, match="sha256 hex"):
        trajectories_to_batch([dataclasses.replace(t, image_refs=["not-a-hash"], num_image_tokens=[4])])
    with pytest.raises(ValueError, match="> 0"):
        trajectories_to_batch([dataclasses.replace(t, image_refs=[RED.sha256], num_image_tokens=[0])])


def test_text_only_run_files_and_batches_unchanged(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append(make_group("g", 4))
    sampled = buf.sample(served_version=0, learner_step=1)
    assert sampled.images is None and sampled.to_padded().images is None
    assert sampled.table.column("image_refs").to_pylist() == [[]] * 4
    buf.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.startswith(IMAGES_PREFIX)], names
    assert set(json.loads((tmp_path / MANIFEST).read_text())["segments"]) == {TRAJ_PREFIX, "consumed"}
    again = ReplayBuffer(_cfg(tmp_path))
    assert again.recovery_report.lines()[0].endswith("consumption records")  # no image clause
    again.close()


def test_schema_v1_log_recovers_with_empty_image_columns(tmp_path):
    """A log written before the image columns existed (schema "1") still recovers, and the next
    process appends image rows next to it."""
    v2 = trajectories_to_batch(make_group("old", 4) + make_group("old2", 4))
    v1 = pa.RecordBatch.from_arrays([v2.column(f.name) for f in TRAJECTORY_SCHEMA_V1], schema=TRAJECTORY_SCHEMA_V1)
    writer = SegmentWriter(tmp_path, prefix=TRAJ_PREFIX, schema=TRAJECTORY_SCHEMA_V1, segment_max_bytes=1 << 20)
    writer.write(v1)
    writer.close()
    table, _, cli_report = read_dir(tmp_path)  # the CLI / export reads it too
    assert cli_report.clean and table.num_rows == 8 and table.column("image_refs").to_pylist() == [[]] * 8
    buf = ReplayBuffer(_cfg(tmp_path))
    report = buf.recovery_report
    assert report.clean and report.num_rows == 8, report.lines()
    sampled = buf.sample(served_version=0, learner_step=1)
    assert sampled.table.column("group_id").to_pylist() == ["old"] * 4 and sampled.images is None
    assert sampled.table.column("image_refs").to_pylist() == [[]] * 4
    expected = normalize_batch(v1)
    assert expected.num_rows == 8 and set(IMAGE_FIELD_NAMES) <= set(expected.schema.names)
    buf.append(_image_group("new", [[RED]] * 4), images=[RED])
    buf.close()
    again = ReplayBuffer(_cfg(tmp_path))  # one schema "1" segment and one schema "2" segment
    assert again.recovery_report.clean and again.recovery_report.num_rows == 12
    groups = []
    step = 2
    while (s := again.sample(served_version=0, learner_step=step)) is not None:
        groups.append((s.table.column("group_id")[0].as_py(), s.to_padded().images))
        step += 1
    assert groups == [("old2", None), ("new", [[RED.data]] * 4)]
    again.close()


def test_image_write_failure_stops_the_rows(tmp_path, monkeypatch):
    """Images are written before the rows go anywhere: if the image log cannot be written, the rows
    are neither in memory nor handed to the trajectory log."""
    buf = ReplayBuffer(_cfg(tmp_path))

    def disk_full(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(buf._images, "_writer_open", disk_full)
    with pytest.raises(OSError, match="disk full"):
        buf.append(_image_group("g", [[RED]] * 4), images=[RED], durable=True)
    assert buf.num_rows_appended == 0 and buf.num_ready() == 0 and RED.sha256 not in buf._images
    monkeypatch.undo()
    buf.append(_image_group("g", [[RED]] * 4), images=[RED], durable=True)
    _crash(buf)
    again = ReplayBuffer(_cfg(tmp_path))
    assert again.recovery_report.num_rows == 4
    assert again.sample(served_version=0, learner_step=1).to_padded().images == [[RED.data]] * 4
    again.close()
