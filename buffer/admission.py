"""Admission control and staleness: pure functions on ints and numpy arrays, no I/O.

Two numbers name "what the engines serve now", in two units, and each function says which it takes:
`served_version` is the policy_version label of the served weights (what the next sampled token
would carry: sampling and lags count in labels), `served_step` is the learner step that produced them
(admission counts in steps: `Pipeline` passes `DriverState.served_step`, which leaves out the label
offset a resume adds, so a resume does not raise capacity by the labels it skipped).

Lag of a token = served_version - policy_version of the weights that sampled it. A trajectory's lag
is taken against its *oldest* sampled token (`min_policy_version`): a multi-turn trajectory that was
interrupted and resumed across weight updates carries several versions, and the first turn is the
stalest part of it. Observation tokens (policy_version -1) have no lag.

Admission (AReaL's staleness manager, counted in trajectories): when the engines serve the weights of
learner step v (`served_step`) and the learner consumes `batch_size` trajectories per step in FIFO
order, the trajectory that starts now is consumed at the latest at step
`(num_accepted + num_running) // batch_size`. Bounding that by `v + max_staleness` gives

    capacity = (max_staleness + v + 1) * batch_size - (num_accepted + num_running)

A trajectory samples its first token at (or after) the version it starts at, so bounding the start
bounds the min policy_version, however many versions its later turns span. Capacity is rounded down
to whole GRPO groups (the n samples of a prompt start together) and clamped by a concurrency limit.
Trajectories that will never be consumed (DAPO-filtered, dropped, evicted) must not count as
accepted, or capacity leaks; every other admitted trajectory counts, including a *finished* member of
a group whose other members still run (it is neither running nor accepted yet, and forgetting it
over-admits by up to group_size - 1 per open group). With `reuse` r each trajectory is handed to the
learner r times, so only batch_size / r fresh trajectories are consumed per step and

    capacity = (max_staleness + v + 1) * batch_size // r - (num_accepted + num_in_flight)

bounds the lag at a trajectory's first use.

With the DAPO filter on (`filter_uniform_reward_groups`) most groups can be dropped when they settle:
early in a run nearly every group's samples get the same reward. The bound above still counts each
of them as a trajectory the learner will consume, so a small `max_staleness` keeps a small window of
groups in flight, most of which are then dropped, and the learner starves while the engines idle.
`admission = "expected"` counts each in-flight trajectory by `kept_share` q, the recent share of
settled groups kept for training (`GroupTable.kept_share`: (kept + 1) / (settled + 1) over the last
`admission_window` groups, so 1 before any settles and never 0):

    capacity = ((max_staleness + v + 1) * batch_size // r - num_accepted) / q - num_in_flight

which bounds the *expected* step at which a new trajectory is consumed by `v + max_staleness`: the
window widens by 1 / q exactly as the filter drops, and a group that still ends up older than the
bound meets the `over_age` policy below. With q = 1 it is the bound.

The bound holds when groups are consumed in start order. They finish in another order (a long group
started at v can settle after shorter groups started at v + 2), so a group can still end up older
than `max_staleness` when it is sampled: the buffer samples the oldest-started ready group first, and
by default (`over_age = "train"`) trains on it with the lag-aware correction instead of dropping it,
which would starve exactly the long trajectories; dropping is an explicit option and is counted by
length bucket (`length_bucket`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from streamrl.buffer.config import AdmissionRule

if TYPE_CHECKING:
    from streamrl.buffer.config import BufferConfig


def rollout_capacity(
    *,
    served_step: int,
    max_staleness: int,
    batch_size: int,
    num_running: int,
    num_accepted: int,
    group_size: int = 1,
    max_concurrent: int | None = None,
    reuse: int = 1,
    kept_share: float = 1.0,
) -> int:
    """How many new trajectories may start now (a multiple of `group_size`, >= 0).

    served_step: learner step of the weights the engines serve (not their label, see the module docstring).
    num_running: admitted and not yet accepted: every member of a group that is still open
        (generating, in tools, parked as a partial row, or finished while its siblings run).
    num_accepted: finished since the run began and kept for training (consumed or waiting).
    max_concurrent: limit on trajectories running at once (compared with num_running).
    kept_share: in (0, 1], the expected share of in-flight trajectories the learner will consume
        (1: all of them, the hard bound; see the module docstring).
    """
    if min(served_step, max_staleness, num_running, num_accepted) < 0:
        raise ValueError("served_step, max_staleness, num_running and num_accepted must be >= 0")
    if batch_size <= 0 or group_size <= 0 or reuse <= 0:
        raise ValueError("batch_size, group_size and reuse must be > 0")
    if not 0 < kept_share <= 1:
        raise ValueError(f"kept_share is in (0, 1], got {kept_share}")
    budget = (max_staleness + served_step + 1) * batch_size // reuse - num_accepted
    capacity = math.floor(budget / kept_share) - num_running if budget > 0 else budget - num_running
    if max_concurrent is not None:
        capacity = min(capacity, max_concurrent - num_running)
    return max(0, capacity // group_size * group_size)


def length_bucket(num_tokens: int) -> int:
    """Power-of-two length bucket: the smallest 2**k >= num_tokens (lengths are compared by bucket
    between what was generated, trained and dropped)."""
    return 1 << max(int(num_tokens) - 1, 0).bit_length()


def buffer_capacity(
    cfg: BufferConfig,
    *,
    served_step: int,
    num_in_flight: int,
    num_accepted: int,
    num_partial: int,
    num_live_rows: int,
    max_concurrent: int | None = None,
    kept_share: float = 1.0,
) -> int:
    """The buffer's whole admission rule (`ReplayBuffer.capacity`) on plain counts: the staleness
    capacity (with `cfg.admission = "expected"`, in-flight groups counted by `kept_share`), cut to the
    room left under `max_concurrent` running trajectories (partial rows) and under `cfg.capacity_rows`
    live rows, in whole groups. Pure, so the simulator (`streamrl.sim`) admits
    exactly as a run does."""
    cap = rollout_capacity(
        served_step=served_step,
        max_staleness=cfg.max_staleness,
        batch_size=cfg.batch_size,
        num_running=num_in_flight,
        num_accepted=num_accepted,
        group_size=cfg.group_size,
        reuse=cfg.reuse,
        kept_share=kept_share if cfg.admission is AdmissionRule.EXPECTED else 1.0,
    )
    if max_concurrent is not None:
        room = max(max_concurrent - num_partial, 0)
        cap = min(cap, room // cfg.group_size * cfg.group_size)
    if cfg.capacity_rows is not None:
        room = max(cfg.capacity_rows - num_live_rows, 0)
        cap = min(cap, room // cfg.group_size * cfg.group_size)
    return cap
