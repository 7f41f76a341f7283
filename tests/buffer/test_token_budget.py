"""`buffer.max_batch_tokens`: a group larger than the budget is trained in a batch of its own and
counted, never dropped (dropping them biased training towards short trajectories)."""

from __future__ import annotations

import numpy as np

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.sampling import select_prefix
from streamrl.buffer.store import ReplayBuffer
from tests.buffer.helpers import make_group


def test_a_group_over_the_token_budget_is_trained_alone():
    # a group of 2 x (3 prompt + 4 response) = 14 tokens; "long" has 2 x (3 + 30) = 66 > 30
    buf = ReplayBuffer(BufferConfig(batch_size=8, group_size=2, max_batch_tokens=30))
    buf.append(
        make_group("a", 2)
        + make_group("long", 2, num_response=30)
        + make_group("b", 2)
        + make_group("c", 2)
        + make_group("d", 2)
    )
    assert buf.stats()["buffer/groups_over_token_budget"] == 1
    got = []
    step = 1
    while (batch := buf.sample(served_version=0, learner_step=step)) is not None:
        got.append(sorted(set(batch.table.column("group_id").to_pylist())))
        step += 1
    assert got == [["a"], ["long"], ["b", "c"]]  # FIFO: a (the next group overflows), long alone, b + c (d waits)
    stats = buf.stats()
    assert stats["buffer/evicted_over_age"] == 0 and stats["buffer/groups_evicted"] == 0
    assert stats["length/trained_le_64"] == 2  # the long trajectories were trained: no length bias


def test_select_prefix_gives_an_oversized_first_group_alone():
    order = np.array([1, 0])
    chosen = select_prefix(
        order,
        num_trajectories=np.array([2, 2]),
        num_tokens=np.array([10, 50]),
        max_groups=4,
        max_trajectories=8,
        token_budget=30,
    )
    assert chosen.tolist() == [1]
