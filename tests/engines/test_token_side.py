"""Per-token side data (routed experts) as buffer data: the record, the Arrow column, the durable log
and crash recovery, the learner's padded array, and logs written before the column existed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from streamrl.buffer import cli
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.log import SegmentWriter
from streamrl.buffer.manifest import TRAJ_PREFIX
from streamrl.buffer.padding import pad_table
from streamrl.buffer.schema import TRAJECTORY_SCHEMA_V3, batch_to_trajectories, normalize_batch, trajectories_to_batch
from streamrl.buffer.store import ReplayBuffer
from streamrl.engines.token_side import SideKind, TokenSide, merge_first, missing_value
from streamrl.rollout.types import AgentData, Trajectory, TrajectoryStatus
from tests.buffer.helpers import make_group, make_traj


def routes(num_tokens: int, seed: int, *, missing: tuple[int, ...] = ()) -> TokenSide:
    rows = np.random.default_rng(seed).integers(0, 4, (num_tokens, 2, 2)).astype(np.uint8)
    rows[list(missing)] = missing_value("uint8")
    return TokenSide.from_array(SideKind.ROUTED_EXPERTS, rows)


def with_routes(t: Trajectory, seed: int, **kw) -> Trajectory:
    side = routes(len(t.prompt_ids) + len(t.response_ids) - 1, seed, **kw)
    data = t.agent_data() if t.agent_data_json else None
    if data is not None:  # a partial row's snapshot carries the same routes, as the agent loop writes it
        data = data.model_copy(update={"token_side": side})
    return dataclasses.replace(t, token_side=side, agent_data_json=data.to_json() if data else None)


def test_merge_keeps_the_first_row_of_every_position():
    first = routes(5, 0, missing=(4,))
    later = routes(8, 1)
    merged = merge_first(first, later)
    assert merged is not None and merged.num_tokens == 8
    assert np.array_equal(merged.array()[:4], first.array()[:4])  # recorded first: kept
    assert np.array_equal(merged.array()[4:], later.array()[4:])  # missing or new: the later rows
    with pytest.raises(ValueError, match="mismatch"):
        merge_first(first, TokenSide.from_array(SideKind.ROUTED_EXPERTS, np.zeros((2, 3, 2), np.uint8)))
    with pytest.raises(ValueError, match="whole rows"):
        TokenSide(kind=SideKind.ROUTED_EXPERTS, dtype="uint8", shape=(2, 2), data=b"\x00" * 5)


def test_agent_data_json_round_trip_and_alignment_check():
    data = AgentData(trajectory_id="t", group_id="g", prompt_ids=[1, 2, 3])
    data.append_sampled([4, 5], [-0.5, -0.25], [0, 0])
    data.record_side(routes(4, 2))
    back = AgentData.from_json(data.to_json())
    assert (
        back == data and back.token_side is not None and np.array_equal(back.token_side.array(), routes(4, 2).array())
    )
    data.record_side(routes(6, 3))  # rows past prompt + response: a bug, caught
    with pytest.raises(AssertionError, match="token side"):
        data.check_aligned()


def test_arrow_round_trip_padding_and_contract():
    plain = make_traj("g", 0)
    moe = with_routes(make_traj("g", 1), 4, missing=(1,))
    batch = trajectories_to_batch([plain, moe])
    assert batch_to_trajectories(batch) == [plain, moe]
    padded = pad_table(batch)
    assert padded.routed_experts is not None and padded.routed_experts.shape == (2, 7, 2, 2)
    assert (padded.routed_experts[0] == -1).all() and (padded.routed_experts[1, 1] == -1).all()
    assert (padded.routed_experts[1, 6] == -1).all()  # the last token has no row
    assert np.array_equal(padded.routed_experts[1, 2:6], moe.token_side.array()[2:6])
    assert pad_table(trajectories_to_batch([plain])).routed_experts is None  # a dense batch
    too_long = dataclasses.replace(plain, token_side=routes(9, 5))
    with pytest.raises(ValueError, match="token_side"):
        trajectories_to_batch([too_long])


def test_durable_routes_survive_a_crash_and_resume(tmp_path):
    """Rows made durable with their routes are recovered with them: the finished ones for the learner,
    the partial one with the routes of every segment so far in its resumable AgentData."""
    cfg = BufferConfig(root_dir=str(tmp_path), batch_size=2, group_size=2)
    done = [with_routes(t, 10 + i) for i, t in enumerate(make_group("done", 2))]
    parked = with_routes(make_traj("run", 0, status=TrajectoryStatus.PARTIAL), 20)
    buf = ReplayBuffer(cfg)
    buf.append(done + [parked], durable=True)
    del buf  # no close: the process died
    recovered = ReplayBuffer(cfg)
    assert recovered.recovery_report.clean
    (resumed,) = recovered.resumable()
    assert resumed.token_side == parked.token_side and resumed.agent_data().token_side == parked.token_side
    sampled = recovered.sample(served_version=0, learner_step=0)
    assert sampled is not None
    by_id = {t.trajectory_id: t for t in batch_to_trajectories(sampled.table)}
    assert all(by_id[t.trajectory_id].token_side == t.token_side for t in done)
    recovered.close()


def test_a_log_written_before_token_side_existed_reads_as_none(tmp_path):
    v4 = trajectories_to_batch(make_group("old", 2))
    v3 = pa.RecordBatch.from_arrays([v4.column(f.name) for f in TRAJECTORY_SCHEMA_V3], schema=TRAJECTORY_SCHEMA_V3)
    writer = SegmentWriter(tmp_path, prefix=TRAJ_PREFIX, schema=TRAJECTORY_SCHEMA_V3, segment_max_bytes=1 << 20)
    writer.write(v3)
    writer.close()
    assert normalize_batch(v3).column("token_side").to_pylist() == [None, None]
    table, _, report = cli.read_dir(tmp_path)
    assert report.clean and table.column("token_side").null_count == 2
