"""`buffer_capacity` and `choose_groups` are the buffer's admission and batching rules as pure
functions (the simulator calls them): on a buffer driven through random appends and samples they
must give what `ReplayBuffer.capacity` and `ReplayBuffer.sample` give."""

from __future__ import annotations

import random

import numpy as np
import pytest

from streamrl.buffer.admission import buffer_capacity
from streamrl.buffer.config import BufferConfig, SamplingPolicy
from streamrl.buffer.sampling import choose_groups
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import TrajectoryStatus
from tests.buffer.helpers import make_traj


@pytest.mark.parametrize("sampling", [SamplingPolicy.FIFO, SamplingPolicy.PRIORITIZED])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pure_rules_match_the_buffer(seed, sampling):
    rnd = random.Random(seed)
    cfg = BufferConfig(batch_size=4, group_size=2, max_staleness=2, capacity_rows=40, sampling=sampling, seed=seed)
    buf = ReplayBuffer(cfg)
    mirror = np.random.default_rng(seed)  # the buffer's own sampling generator, replayed
    served, step, open_groups, n = 0, 0, [], 0
    for _ in range(60):
        g = buf._groups
        for max_concurrent in (None, 3, 7):
            expected = buffer_capacity(
                cfg,
                served_version=served,
                num_in_flight=g.num_in_flight,
                num_accepted=g.num_accepted,
                num_partial=g.num_partial,
                num_live_rows=buf._rows.num_live,
                max_concurrent=max_concurrent,
            )
            assert buf.capacity(served_version=served, max_concurrent=max_concurrent) == expected
        action = rnd.random()
        if action < 0.4 and buf.capacity(served_version=served) >= 2:
            gid = f"g{n}"
            n += 1
            buf.append([make_traj(gid, i, status=TrajectoryStatus.PARTIAL, version=served) for i in range(2)])
            open_groups.append((gid, served))
        elif action < 0.8 and open_groups:
            gid, version = open_groups.pop(rnd.randrange(len(open_groups)))
            buf.append([make_traj(gid, i, reward=rnd.random(), version=version) for i in range(2)])
        else:
            chosen = choose_groups(cfg, list(g.ready.values()), served_version=served, rng=mirror)
            batch = buf.sample(served_version=served, learner_step=step + 1)
            assert (batch is None) == (chosen is None)
            if batch is not None:
                assert batch.trajectory_ids == [m.trajectory_id for c in chosen for m in c.finished]
                step, served = step + 1, served + rnd.randint(0, 1)
