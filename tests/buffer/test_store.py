"""In-memory behaviour of the replay buffer: groups, supersession, sampling, staleness, padding."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.buffer.types import PaddedBatch
from streamrl.rollout.types import TrajectoryStatus
from tests.buffer.helpers import make_group, make_traj

P = TrajectoryStatus.PARTIAL


def _buf(**kw) -> ReplayBuffer:
    kw.setdefault("batch_size", 2)
    kw.setdefault("group_size", 2)
    return ReplayBuffer(BufferConfig(**kw))


def test_config_rejects_partial_groups_per_batch():
    with pytest.raises(ValueError, match="multiple of group_size"):
        BufferConfig(batch_size=6, group_size=4)


def test_group_is_sampled_only_when_complete():
    buf = _buf(batch_size=4, group_size=2)
    buf.append([make_traj("a", 0, reward=1.0), make_traj("b", 0), make_traj("b", 1, status=P)])
    assert buf.num_ready() == 0
    assert buf.sample(served_version=0, learner_step=1) is None
    buf.append([make_traj("a", 1)])
    assert buf.num_ready() == 2
    assert buf.sample(served_version=0, learner_step=1) is None  # one complete group, batch needs two
    buf.append([make_traj("b", 1)])  # finished row supersedes the partial one
    batch = buf.sample(served_version=0, learner_step=1)
    assert batch.trajectory_ids == ["a/0", "a/1", "b/0", "b/1"]
    assert batch.table.column("status").to_pylist() == ["finished"] * 4
    assert buf.sample(served_version=0, learner_step=2) is None
    assert buf.stats()["buffer/live_rows"] == 0


def test_partial_superseded_and_resumable():
    buf = _buf()
    buf.append([make_traj("a", 0, status=P, num_response=2)])
    buf.append([make_traj("a", 0, status=P, num_response=4), make_traj("a", 1, status=P)])
    resumable = buf.resumable()
    assert sorted(t.trajectory_id for t in resumable) == ["a/0", "a/1"]
    assert next(t for t in resumable if t.trajectory_id == "a/0").num_response_tokens == 4  # the latest row
    assert resumable[0].agent_data().trajectory_id in {"a/0", "a/1"}
    buf.append([make_traj("a", 0)])
    assert [t.trajectory_id for t in buf.resumable()] == ["a/1"]
    assert buf.stats()["buffer/partial_trajectories"] == 1


def test_failed_members_are_not_sampled_and_too_few_finished_drops_group():
    buf = _buf(batch_size=4, group_size=4, min_finished_per_group=2)
    buf.append(make_group("a", 4, rewards=[0, 1, 2, 3])[:3] + [make_traj("a", 3, status=TrajectoryStatus.FAILED)])
    batch = buf.sample(served_version=0, learner_step=1)
    assert batch.trajectory_ids == ["a/0", "a/1", "a/2"]
    fails = [make_traj("b", i, status=TrajectoryStatus.FAILED) for i in range(3)] + [make_traj("b", 3)]
    buf.append(fails)
    assert buf.num_ready() == 0 and buf.stats()["buffer/groups_dropped"] == 1


def test_dapo_filter_drops_uniform_reward_groups_with_metric():
    buf = _buf(filter_uniform_reward_groups=True)
    buf.append(make_group("same", 2, rewards=[1.0, 1.0]) + make_group("diff", 2, rewards=[0.0, 1.0]))
    assert buf.stats()["buffer/groups_filtered"] == 1
    assert buf.sample(served_version=0, learner_step=1).trajectory_ids == ["diff/0", "diff/1"]
    assert buf.stats()["buffer/accepted_trajectories"] == 2  # filtered ones do not take admission capacity


def test_gradient_share_counts_generated_trajectories_that_reached_the_learner():
    buf = _buf(filter_uniform_reward_groups=True, reuse=2)
    buf.append(make_group("same", 2, rewards=[1.0, 1.0]) + make_group("diff", 2, rewards=[0.0, 1.0]))
    buf.append(make_group("late", 2, rewards=[0.0, 1.0]))
    stats = buf.stats()
    assert (stats["buffer/trajectories_generated"], stats["buffer/trajectories_trained"]) == (6, 0)
    buf.sample(served_version=0, learner_step=1)
    buf.sample(served_version=0, learner_step=2)  # "diff" again (reuse 2) or "late": each counted once
    buf.sample(served_version=0, learner_step=3)
    stats = buf.stats()
    assert stats["buffer/trajectories_trained"] == 4  # the filtered group never reaches a gradient
    assert stats["buffer/gradient_share"] == pytest.approx(4 / 6)


def test_group_overflow_is_a_clear_error_and_late_rows_are_ignored():
    buf = _buf()
    buf.append(make_group("a", 2))
    with pytest.raises(ValueError, match="group_size"):
        buf.append([make_traj("c", 0), make_traj("c", 1), make_traj("c", 2)])
    buf.sample(served_version=0, learner_step=1)
    buf.append([make_traj("a", 0)])  # duplicate after consumption: never handed out twice
    assert buf.sample(served_version=0, learner_step=2) is None
    assert buf.stats()["buffer/late_rows_ignored"] == 1


def test_fifo_order_and_reuse_count():
    buf = _buf(reuse=2)
    for g in "abc":
        buf.append(make_group(g, 2))
    got = [buf.sample(served_version=0, learner_step=s).table.column("group_id")[0].as_py() for s in range(6)]
    assert got == ["a", "b", "c", "a", "b", "c"]
    assert buf.sample(served_version=0, learner_step=7) is None


def test_uniform_and_prioritized_sampling():
    buf = _buf(sampling="uniform", seed=1)
    for g in range(20):
        buf.append(make_group(f"g{g:02d}", 2))
    order = [buf.sample(served_version=0, learner_step=s).table.column("group_id")[0].as_py() for s in range(20)]
    assert sorted(order) == [f"g{g:02d}" for g in range(20)] and order != sorted(order)

    # prioritized: reward spread and freshness raise the weight; a flat-reward stale group goes last
    picks = []
    for seed in range(30):
        buf = _buf(sampling="prioritized", seed=seed, max_staleness=10, lag_decay=0.25)
        buf.append(make_group("flat_stale", 2, rewards=[0.0, 0.0], version=0))
        buf.append(make_group("spread_fresh", 2, rewards=[0.0, 1.0], version=4))
        picks.append(buf.sample(served_version=4, learner_step=0).table.column("group_id")[0].as_py())
    assert picks.count("spread_fresh") >= 28


def test_token_budget_batches_whole_groups():
    # each trajectory: 3 prompt + 4 response = 7 tokens; a group of 2 = 14 tokens
    buf = _buf(batch_size=8, group_size=2, max_batch_tokens=30)
    buf.append(make_group("a", 2))
    assert buf.sample(served_version=0, learner_step=1) is None  # 14 tokens, next could still fit
    buf.append(make_group("b", 2))
    assert buf.sample(served_version=0, learner_step=1) is None  # 28 <= 30, batch not yet full
    buf.append(make_group("c", 2))
    batch = buf.sample(served_version=0, learner_step=1)
    assert batch.trajectory_ids == ["a/0", "a/1", "b/0", "b/1"]  # c would overflow 30
    assert batch.to_padded().num_tokens == 28
    big = _buf(batch_size=2, group_size=2, max_batch_tokens=10)
    big.append(make_group("huge", 2))
    assert big.stats()["buffer/groups_over_token_budget"] == 1


@pytest.mark.parametrize("policy", ["evict", "keep"])  # explicit options; the default trains them
def test_over_age_groups_are_never_sampled_and_counted(policy, caplog):
    buf = _buf(max_staleness=1, over_age=policy)
    buf.append(make_group("old", 2, version=0) + make_group("new", 2, version=2))
    batch = buf.sample(served_version=2, learner_step=5)
    assert batch.trajectory_ids == ["new/0", "new/1"]
    assert batch.lags.tolist() == [0, 0]
    stats = buf.stats()
    key = "buffer/evicted_over_age" if policy == "evict" else "buffer/over_age_kept"
    assert stats[key] == 2 and stats["buffer/accepted_trajectories"] == 2
    assert stats["buffer/live_rows"] == (0 if policy == "evict" else 2)
    assert "exceeds max_staleness" in caplog.text


def test_lag_histogram_at_consume_time():
    buf = _buf(max_staleness=3)
    buf.append(make_group("a", 2, version=1))
    buf.sample(served_version=3, learner_step=1)
    stats = buf.stats()
    assert stats["staleness/lag_frac/tokens/2"] == 1.0 and stats["staleness/lag_frac/trajectories/2"] == 1.0
    assert stats["staleness/lag_frac/tokens/over"] == 0.0 and stats["staleness/lag_frac/tokens/0"] == 0.0
    assert stats["staleness/trajectory_lag_mean"] == 2.0


def test_backpressure_room():
    buf = _buf(capacity_rows=4)
    assert buf.has_room(2)
    buf.append(make_group("a", 2) + [make_traj("c", 0)])
    assert not buf.has_room(2) and buf.has_room(1)
    buf.sample(served_version=0, learner_step=1)
    assert buf.has_room(3)


def test_capacity_uses_accepted_and_in_flight_counts():
    buf = _buf(batch_size=4, group_size=2, max_staleness=1)
    buf.append(make_group("a", 2) + make_group("b", 2))
    buf.append([make_traj("c", 0, status=TrajectoryStatus.PARTIAL), make_traj("c", 1)])
    # (1 + 0 + 1) * 4 - (4 accepted + 2 in flight: c/0 partial, c/1 finished in an open group) = 2
    assert buf.capacity(served_step=0) == 2


def test_padded_batch_layout():
    buf = _buf(batch_size=2, group_size=2)
    buf.append(
        [
            make_traj("g", 0, num_prompt=2, num_response=3, version=4),
            make_traj("g", 1, num_prompt=3, num_response=5, version=5),
        ]
    )
    pb: PaddedBatch = buf.sample(served_version=5, learner_step=1).to_padded()
    assert pb.input_ids.shape == (2, 8) and pb.input_ids.dtype == np.int64
    assert pb.input_ids[0].tolist() == [100, 101, 200, 201, 202, 0, 0, 0]
    assert pb.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pb.loss_mask[0].tolist() == [0, 0, 1, 0, 1, 0, 0, 0]
    assert pb.policy_versions[0].tolist() == [-1, -1, 4, -1, 4, -1, -1, -1]
    assert pb.behavior_logprobs[0].tolist() == [0, 0, -0.5, 0, -1.0, 0, 0, 0]
    assert pb.loss_mask[1].tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert pb.prompt_lens.tolist() == [2, 3] and pb.seq_lens.tolist() == [5, 8]
    assert pb.group_index.tolist() == [0, 0] and pb.group_ids == ["g", "g"]
    assert pb.rewards.dtype == np.float32 and pb.turn_scores == [[], []]
    assert pb.trajectory_ids == ["g/0", "g/1"]


def test_memory_is_released_and_compacted():
    buf = _buf(batch_size=2, group_size=2, flush_every_rows=1000)
    for g in range(50):
        buf.append(make_group(f"g{g}", 2, num_response=500))
    buf.flush()  # coalesces the 50 small appends into one chunk
    assert buf.stats()["buffer/chunks"] == 1
    full = buf.memory_bytes()
    for s in range(40):
        buf.sample(served_version=0, learner_step=s)
    assert buf.memory_bytes() < full / 2
    assert [buf.sample(served_version=0, learner_step=100 + s).trajectory_ids[0] for s in range(10)] == [
        f"g{g}/0" for g in range(40, 50)
    ]


def test_a_sample_that_finds_no_batch_writes_nothing_and_one_that_does_flushes_first(tmp_path):
    """The driver asks for a batch after every append: asking must not flush the log each time (one
    frame per append), and a batch's rows are still in the log before its consumption record."""
    buf = _buf(root_dir=str(tmp_path), flush_every_ms=3_600_000, flush_every_rows=1_000, coalesce_below_rows=8)
    buf.append([make_traj("a", 0)])  # half a group: nothing to sample
    flushes = buf.stats()["buffer/flushes"]
    for _ in range(5):
        assert buf.sample(served_version=0, learner_step=1) is None
    assert buf.stats()["buffer/flushes"] == flushes
    buf.append([make_traj("a", 1)])
    assert buf.sample(served_version=0, learner_step=1) is not None
    assert buf.stats()["buffer/flushes"] == flushes + 1
    buf.close()
    reopened = _buf(root_dir=str(tmp_path))
    assert reopened.stats()["buffer/recovered_rows"] == 2 and reopened.stats()["buffer/trajectories_consumed"] == 2
    reopened.close()


def test_expected_admission_reads_the_kept_share_of_recent_groups():
    from streamrl.buffer.config import AdmissionRule

    def settle(buf: ReplayBuffer, names: list[str], kept: set[str]) -> None:
        for name in names:
            buf.append(make_group(name, 2, rewards=[0.0, 1.0] if name in kept else [0.0, 0.0]))

    bound = _buf(filter_uniform_reward_groups=True, max_staleness=1)
    expected = _buf(filter_uniform_reward_groups=True, max_staleness=1, admission=AdmissionRule.EXPECTED)
    expected_small = _buf(
        filter_uniform_reward_groups=True, max_staleness=1, admission=AdmissionRule.EXPECTED, admission_window=2
    )
    for buf in (bound, expected, expected_small):
        assert buf.capacity(served_step=0) == 4  # nothing settled yet: (1 + 0 + 1) * 2, the bound
        settle(buf, ["f1", "f2", "k1", "f3", "f4"], kept={"k1"})  # 1 of 5 groups kept
    assert bound.capacity(served_step=0) == 2  # the kept group's 2 trajectories are accepted: 4 - 2
    # (4 - 2) / ((1 + 1) / (5 + 1)) = 6 trajectories, in whole groups of 2
    assert expected.capacity(served_step=0) == 6
    # the last 2 settled were both filtered: (4 - 2) / (1 / 3) = 6 as well; a kept group then moves it
    assert expected_small.capacity(served_step=0) == 6
    settle(expected_small, ["k2"], kept={"k2"})  # window [f4, k2]: (1 + 1) / 3, 4 accepted: budget 0
    assert expected_small.capacity(served_step=0) == 0
    assert expected_small.capacity(served_step=1) == 2  # (1 + 1 + 1) * 2 - 4 = 2, / (2 / 3) = 3, whole groups: 2
