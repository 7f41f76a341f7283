"""The `teacher_logprobs` column (distillation): durable with its row through a crash, padded onto the
response positions for the learner, and null in logs written before the column existed (schema 4)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from streamrl.buffer import cli
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.log import SegmentWriter
from streamrl.buffer.manifest import TRAJ_PREFIX
from streamrl.buffer.padding import pad_table
from streamrl.buffer.schema import TRAJECTORY_SCHEMA_V4, normalize_batch, trajectories_to_batch
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import Trajectory
from tests.buffer.helpers import make_group


def scored(t: Trajectory, offset: float) -> Trajectory:
    """`t` with teacher log-probs of 1/8ths (float32-exact), 0 at its observation tokens."""
    teacher = [-(i + 1) / 8 - offset if m else 0.0 for i, m in enumerate(t.response_mask)]
    return dataclasses.replace(t, teacher_logprobs=teacher)


def test_teacher_logprobs_survive_a_crash_and_pad_onto_the_response(tmp_path):
    cfg = BufferConfig(root_dir=str(tmp_path), batch_size=2, group_size=2)
    rows = [scored(t, i) for i, t in enumerate(make_group("g", 2))]
    buf = ReplayBuffer(cfg)
    buf.append(rows, durable=True)
    del buf  # no close: the process died
    recovered = ReplayBuffer(cfg)
    sampled = recovered.sample(served_version=0, learner_step=1)
    assert sampled is not None
    padded = sampled.to_padded()
    assert padded.teacher_logprobs is not None
    for b, tid in enumerate(padded.trajectory_ids):
        row = next(r for r in rows if r.trajectory_id == tid)
        start = len(row.prompt_ids)
        got = padded.teacher_logprobs[b]
        assert np.isnan(got[:start]).all() and np.isnan(got[start + len(row.response_ids) :]).all()
        assert got[start : start + len(row.response_ids)].tolist() == row.teacher_logprobs
    recovered.close()


def test_a_batch_with_an_unscored_row_pads_it_with_nan():
    rows = [scored(make_group("g", 2)[0], 0.0), make_group("g", 2)[1]]
    padded = pad_table(trajectories_to_batch(rows))
    assert padded.teacher_logprobs is not None and np.isnan(padded.teacher_logprobs[1]).all()
    assert pad_table(trajectories_to_batch(make_group("h", 2))).teacher_logprobs is None


def test_a_log_written_before_the_teacher_column_existed_reads_as_null(tmp_path):
    v5 = trajectories_to_batch(make_group("old", 2))
    v4 = pa.RecordBatch.from_arrays([v5.column(f.name) for f in TRAJECTORY_SCHEMA_V4], schema=TRAJECTORY_SCHEMA_V4)
    writer = SegmentWriter(tmp_path, prefix=TRAJ_PREFIX, schema=TRAJECTORY_SCHEMA_V4, segment_max_bytes=1 << 20)
    writer.write(v4)
    writer.close()
    assert normalize_batch(v4).column("teacher_logprobs").to_pylist() == [None, None]
    table, _, report = cli.read_dir(tmp_path)
    assert report.clean and table.column("teacher_logprobs").null_count == 2
