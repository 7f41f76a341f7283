"""Trajectory and GRPO-group bookkeeping of the buffer: supersession, completion, consumption.

A group (the `group_size` samples of one `group_id`) moves through phases:

    OPEN --all members terminal--> READY --consumed `reuse` times--> CONSUMED
      |                              |
      |                              +--lag > max_staleness--> EVICTED / OVER_AGE (kept, never sampled)
      +--fewer than min_finished_per_group finished--> DROPPED
      +--all finished rewards equal and DAPO filter on--> FILTERED

While OPEN, a later row of a trajectory supersedes the earlier one (partial -> partial -> finished).
Once a group has left OPEN, further rows for it are late duplicates and are ignored (counted), which
is what makes consumption exactly-once. This module holds no Arrow data: it tells the caller which
row ids died so the row store can free them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum

from rollout.types import OBSERVATION_VERSION, TrajectoryStatus

logger = logging.getLogger(__name__)


class GroupPhase(StrEnum):
    OPEN = "open"
    READY = "ready"
    CONSUMED = "consumed"
    FILTERED = "filtered"
    DROPPED = "dropped"
    EVICTED = "evicted"
    OVER_AGE = "over_age"


@dataclass(kw_only=True, slots=True)
class TrajState:
    trajectory_id: str
    row: int  # id of the latest row in the row store
    status: TrajectoryStatus
    sample_index: int
    num_tokens: int  # prompt + response
    reward: float
    min_policy_version: int
    consume_steps: list[int] = field(default_factory=list)  # learner steps that consumed it


@dataclass(kw_only=True, slots=True)
class GroupState:
    group_id: str
    members: dict[str, TrajState] = field(default_factory=dict)
    phase: GroupPhase = GroupPhase.OPEN
    num_uses: int = 0
    # set when the group becomes READY:
    finished: list[TrajState] = field(default_factory=list)  # sampled members, sample_index order
    min_policy_version: int = OBSERVATION_VERSION
    num_tokens: int = 0
    reward_std: float = 0.0


@dataclass(kw_only=True, slots=True)
class RowUpdate:
    trajectory_id: str
    group_id: str
    row: int
    status: TrajectoryStatus
    sample_index: int
    num_tokens: int
    reward: float
    min_policy_version: int


class GroupTable:
    """All groups by id; `ready` keeps READY groups in FIFO (settle) order."""

    def __init__(self, *, group_size: int, reuse: int, min_finished: int, filter_uniform: bool) -> None:
        self.group_size = group_size
        self.reuse = reuse
        self.min_finished = min_finished
        self.filter_uniform = filter_uniform
        self.groups: dict[str, GroupState] = {}
        self.ready: dict[str, GroupState] = {}
        self.trajectories: dict[str, GroupState] = {}  # trajectory_id -> its group
        self.preloaded_steps: dict[str, list[int]] = {}  # recovery: consumption history by trajectory
        self.counts = {phase: 0 for phase in GroupPhase}
        self.num_late_rows = 0
        self.num_partial = 0
        self.num_accepted = 0  # finished trajectories kept for training (READY or CONSUMED groups)

    def check_overflow(self, updates: list[tuple[str, str]]) -> None:
        """Raise ValueError before any mutation if (trajectory_id, group_id) pairs overflow a group."""
        new_per_group: dict[str, set[str]] = {}
        for tid, gid in updates:
            if tid not in self.trajectories:
                new_per_group.setdefault(gid, set()).add(tid)
        for gid, tids in new_per_group.items():
            group = self.groups.get(gid)
            known = len(group.members) if group is not None else 0
            if group is not None and group.phase is not GroupPhase.OPEN:
                continue  # late rows of a closed group are ignored, not an overflow
            if known + len(tids) > self.group_size:
                raise ValueError(
                    f"group {gid!r} would have {known + len(tids)} trajectories but group_size is "
                    f"{self.group_size}; group_id must identify one GRPO group of n samples"
                )

    def apply(self, u: RowUpdate) -> list[int]:
        """Apply one row; returns ids of rows that died (superseded, late, or of a closed group)."""
        group = self.trajectories.get(u.trajectory_id) or self.groups.get(u.group_id)
        if group is None:
            group = self.groups[u.group_id] = GroupState(group_id=u.group_id)
            self.counts[GroupPhase.OPEN] += 1
        if group.phase is not GroupPhase.OPEN:
            self.num_late_rows += 1
            logger.warning("ignoring late row of trajectory %s: group %s is %s", u.trajectory_id, u.group_id, group.phase)
            return [u.row]
        dead: list[int] = []
        old = group.members.get(u.trajectory_id)
        if old is not None:
            dead.append(old.row)
            self.num_partial -= old.status is TrajectoryStatus.PARTIAL
        self.num_partial += u.status is TrajectoryStatus.PARTIAL
        group.members[u.trajectory_id] = TrajState(
            trajectory_id=u.trajectory_id,
            row=u.row,
            status=u.status,
            sample_index=u.sample_index,
            num_tokens=u.num_tokens,
            reward=u.reward,
            min_policy_version=u.min_policy_version,
            consume_steps=self.preloaded_steps.pop(u.trajectory_id, old.consume_steps if old else []),
        )
        self.trajectories[u.trajectory_id] = group
        if len(group.members) == self.group_size and all(
            m.status is not TrajectoryStatus.PARTIAL for m in group.members.values()
        ):
            dead.extend(self._settle(group))
        return dead

    def _settle(self, group: GroupState) -> list[int]:
        finished = sorted(
            (m for m in group.members.values() if m.status is TrajectoryStatus.FINISHED), key=lambda m: m.sample_index
        )
        failed_rows = [m.row for m in group.members.values() if m.status is not TrajectoryStatus.FINISHED]
        rewards = [m.reward for m in finished]
        if len(finished) < self.min_finished:
            return self._close(group, GroupPhase.DROPPED)
        if self.filter_uniform and max(rewards) == min(rewards):
            return self._close(group, GroupPhase.FILTERED)
        group.finished = finished
        sampled_versions = [m.min_policy_version for m in finished if m.min_policy_version >= 0]
        group.min_policy_version = min(sampled_versions, default=OBSERVATION_VERSION)
        group.num_tokens = sum(m.num_tokens for m in finished)
        mean = sum(rewards) / len(rewards)
        group.reward_std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        group.num_uses = max(len(m.consume_steps) for m in finished)
        self.num_accepted += len(finished)
        if group.num_uses >= self.reuse:
            return failed_rows + self._close(group, GroupPhase.CONSUMED)
        self._move(group, GroupPhase.READY)
        self.ready[group.group_id] = group
        return failed_rows

    def consume(self, group: GroupState, learner_step: int) -> list[int]:
        """Record one use of a READY group at `learner_step`; returns rows that died."""
        assert group.phase is GroupPhase.READY, f"consuming group {group.group_id} in phase {group.phase}"
        for m in group.finished:
            m.consume_steps.append(learner_step)
        group.num_uses += 1
        if group.num_uses >= self.reuse:
            return self._close(group, GroupPhase.CONSUMED)
        self.ready.pop(group.group_id)
        self.ready[group.group_id] = group  # back of the FIFO for its next use
        return []

    def retire(self, group: GroupState, phase: GroupPhase) -> list[int]:
        """Take a READY group out of sampling (over-age): EVICTED frees its rows, OVER_AGE keeps them."""
        assert phase in (GroupPhase.EVICTED, GroupPhase.OVER_AGE)
        self.num_accepted -= len(group.finished)  # never consumed: frees admission capacity
        if phase is GroupPhase.OVER_AGE:
            self.ready.pop(group.group_id, None)
            self._move(group, phase)
            return []
        return self._close(group, phase)

    def _close(self, group: GroupState, phase: GroupPhase) -> list[int]:
        self.ready.pop(group.group_id, None)
        self._move(group, phase)
        return [m.row for m in group.members.values()]

    def _move(self, group: GroupState, phase: GroupPhase) -> None:
        self.counts[group.phase] -= 1
        self.counts[phase] += 1
        group.phase = phase

    def resumable_rows(self) -> list[int]:
        return [
            m.row
            for g in self.groups.values()
            if g.phase is GroupPhase.OPEN
            for m in g.members.values()
            if m.status is TrajectoryStatus.PARTIAL
        ]

    @property
    def num_ready_trajectories(self) -> int:
        return sum(len(g.finished) for g in self.ready.values())
