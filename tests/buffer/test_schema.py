"""The Arrow schema mirrors the Trajectory record and round-trips it."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pyarrow as pa
import pytest

from streamrl.buffer.schema import (
    DERIVED_FIELDS,
    IMAGE_FIELD_NAMES,
    RECORD_FIELD_NAMES,
    TRAJECTORY_SCHEMA,
    batch_to_trajectories,
    is_validated,
    normalize_batch,
    record_field_names,
    trajectories_to_batch,
)
from streamrl.rollout.types import AgentData, AgentState, FinishReason, Trajectory, TrajectoryStatus
from streamrl.tools.types import ToolResult
from tests.buffer.helpers import make_traj


def _rich_trajectory() -> Trajectory:
    agent = AgentData(
        trajectory_id="t1",
        group_id="g",
        state=AgentState.PROCESSING_TOOLS,
        messages=[{"role": "user", "content": "héllo ✓"}],
        prompt_ids=[1, 2],
        response_ids=[5, 6, 7],
        response_mask=[1, 1, 0],
        behavior_logprobs=[-0.1, -0.2, 0.0],
        policy_versions=[3, 4, -1],
        tool_results=[ToolResult(call_id="c", name="calc", text="42")],
    )
    return Trajectory(
        trajectory_id="t1",
        group_id="g",
        sample_index=3,
        agent_name="tool_agent",
        prompt_ids=[1, 2],
        response_ids=[5, 6, 7],
        response_mask=[1, 1, 0],
        behavior_logprobs=[-0.1, -0.2, 0.0],  # not float32-representable
        policy_versions=[3, 4, -1],
        reward=0.123456789012345,
        turn_scores=[0.5, 1.0],
        tool_rewards=[0.25],
        num_turns=3,
        num_tool_calls=1,
        num_tool_errors=0,
        status=TrajectoryStatus.PARTIAL,
        finish_reason=FinishReason.ABORT,
        num_interrupts=2,
        generate_s=1.5,
        tool_s=0.25,
        created_at=1700000000.123456,
        finished_at=0.0,
        agent_data_json=agent.to_json(),
    )


def test_schema_mirrors_record_field_for_field():
    assert RECORD_FIELD_NAMES == record_field_names()
    assert RECORD_FIELD_NAMES[-len(IMAGE_FIELD_NAMES) :] == IMAGE_FIELD_NAMES  # the image columns come last
    assert TRAJECTORY_SCHEMA.names == [*record_field_names(), *(f.name for f in DERIVED_FIELDS)]
    assert TRAJECTORY_SCHEMA.field("image_refs").type == pa.list_(pa.string())
    assert TRAJECTORY_SCHEMA.field("num_image_tokens").type == pa.list_(pa.int32())
    assert TRAJECTORY_SCHEMA.field("response_ids").type == pa.list_(pa.int32())
    assert TRAJECTORY_SCHEMA.field("response_mask").type == pa.list_(pa.int8())
    assert TRAJECTORY_SCHEMA.field("behavior_logprobs").type == pa.list_(pa.float32())
    assert TRAJECTORY_SCHEMA.field("policy_versions").type == pa.list_(pa.int32())


def test_round_trip_is_identical_for_float32_logprobs():
    trajs = [
        make_traj("g", 0, reward=0.1),
        make_traj("g", 1, status=TrajectoryStatus.PARTIAL),
        make_traj("h", 0, num_response=0),
    ]
    assert batch_to_trajectories(trajectories_to_batch(trajs)) == trajs


def test_round_trip_rich_record_float32_cast_logprobs_and_agent_data():
    t = _rich_trajectory()
    back = batch_to_trajectories(trajectories_to_batch([t]))[0]
    expected = dataclasses.replace(t, behavior_logprobs=[float(np.float32(x)) for x in t.behavior_logprobs])
    assert back == expected
    assert back.agent_data() == t.agent_data()
    assert back.status is TrajectoryStatus.PARTIAL and back.finish_reason is FinishReason.ABORT
    # Arrow -> record -> Arrow is bit-identical
    batch = trajectories_to_batch([t])
    assert trajectories_to_batch(batch_to_trajectories(batch)).equals(batch)


def test_derived_columns():
    t = _rich_trajectory()
    row = trajectories_to_batch([t, make_traj("h", 0, num_response=0)]).to_pydict()
    assert row["num_prompt_tokens"] == [2, 3]
    assert row["num_response_tokens"] == [3, 0]
    assert row["min_policy_version"] == [3, -1]
    assert row["max_policy_version"] == [4, -1]


def test_normalize_recomputes_derived_and_rejects_bad_rows():
    batch = trajectories_to_batch([make_traj("g", 0, version=5)])
    tampered = batch.set_column(
        batch.schema.get_field_index("min_policy_version"), "min_policy_version", pa.array([0], pa.int32())
    )
    assert normalize_batch(tampered).column("min_policy_version").to_pylist() == [5]
    with pytest.raises(ValueError, match="missing trajectory columns"):
        normalize_batch(batch.drop_columns(["reward"]))
    bad = make_traj("g", 1)
    bad.policy_versions[0] = -1  # sampled token without a version
    with pytest.raises(ValueError, match="g/1"):
        trajectories_to_batch([bad])
    short = make_traj("g", 2)
    short.behavior_logprobs.pop()
    with pytest.raises(ValueError, match="misaligned"):
        trajectories_to_batch([short])
    status = batch.set_column(batch.schema.get_field_index("status"), "status", pa.array(["done"]))
    with pytest.raises(ValueError, match="unknown values"):
        normalize_batch(status)


def test_sliced_batch_normalizes_with_correct_offsets():
    batch = trajectories_to_batch([make_traj("g", i, version=i) for i in range(4)])
    part = normalize_batch(batch.slice(2, 2))
    assert part.column("min_policy_version").to_pylist() == [2, 3]


def test_validated_stamp_is_trusted_and_survives_transport():
    batch = trajectories_to_batch([make_traj("g", i, version=i) for i in range(3)])
    assert is_validated(batch)
    assert normalize_batch(batch) is batch  # checked once, at the producer
    carried = pickle.loads(pickle.dumps(batch))  # what the Ray object store does
    assert is_validated(carried) and normalize_batch(carried) is carried
    copied = batch.take(pa.array([0, 1, 2]))
    assert is_validated(copied)
    assert not is_validated(batch.slice(1, 2))  # sliced columns are checked in full
    unstamped = pa.RecordBatch.from_arrays(batch.columns, schema=TRAJECTORY_SCHEMA)
    assert not is_validated(unstamped) and is_validated(normalize_batch(unstamped))


def test_tampered_stamped_batch_is_checked_again():
    batch = trajectories_to_batch([make_traj("g", 0, version=2)])
    i = batch.schema.get_field_index("response_mask")
    zero_mask = pa.array([[0, 0, 0, 0]], pa.list_(pa.int8()))  # sampled tokens relabelled as observations
    with pytest.raises(ValueError, match="g/0"):
        normalize_batch(batch.set_column(i, "response_mask", zero_mask))
    i = batch.schema.get_field_index("reward")
    with pytest.raises(ValueError, match="nulls"):
        normalize_batch(batch.set_column(i, "reward", pa.array([None], pa.float64())))
    i = batch.schema.get_field_index("max_policy_version")
    forged = batch.set_column(i, "max_policy_version", pa.array([9], pa.int32()))
    assert normalize_batch(forged).column("max_policy_version").to_pylist() == [2]
