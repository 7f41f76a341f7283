"""Trajectory and GRPO-group bookkeeping of the buffer: supersession, completion, consumption.

A group (the `group_size` samples of one `group_id`) moves through phases:

    OPEN --all members terminal--> READY --consumed `reuse` times--> CONSUMED
      |                              |
      |                              +--lag > max_staleness--> EVICTED / OVER_AGE (kept, never sampled)
      |                              +--images lost before a restart--> DROPPED
      +--fewer than min_finished_per_group finished--> DROPPED
      +--all finished rewards equal and DAPO filter on--> FILTERED

While OPEN, a later row of a trajectory supersedes an earlier *partial* row (partial -> partial ->
finished). Rows are fenced by their `attempt` (0 for the first submission, +1 each time the driver
hands the trajectory to another worker after its holder died, recorded durably in a partial row
before the new holder gets it): a row whose attempt is lower than the trajectory's current one (the
highest of its accepted rows) is refused and counted as stale (`num_stale_attempt_rows`), whatever
its status: a dead worker's late append can neither replace the state the resubmitted attempt resumes
from nor finish the trajectory in its place. Among rows of the current attempt or a newer one, the
first terminal row (finished or failed) is final: a later row for it is refused and counted as late,
whether a duplicate finish or a stale partial row. Once a group has left OPEN, further rows for it are
late duplicates and are ignored (counted), which is what makes consumption exactly-once. `kept_rows`
applies the same rules to a log read back. This module holds no Arrow data: it tells the caller which
row ids died so the row store can free them.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter

from streamrl.buffer.admission import length_bucket
from streamrl.rollout.types import OBSERVATION_VERSION, TrajectoryStatus

logger = logging.getLogger(__name__)
_sample_index = attrgetter("sample_index")


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
    attempt: int = 0  # the trajectory's current attempt: rows of a lower one are refused
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
    num_partial_members: int = 0  # members whose latest row is PARTIAL (the group settles at 0)

    @property
    def finished_rewards(self) -> tuple[float, ...]:
        """The rewards of the members whose latest row is FINISHED, in sample_index order (in any phase:
        `finished` holds them only while the group is sampled)."""
        members = sorted(self.members.values(), key=_sample_index)
        return tuple(m.reward for m in members if m.status is TrajectoryStatus.FINISHED)


@dataclass(kw_only=True, slots=True)
class RowColumns:
    """The bookkeeping columns of consecutive rows `first_row, first_row + 1, ...` (one appended
    batch), as plain Python lists of equal length."""

    first_row: int
    trajectory_ids: list[str]  # [num_rows]
    group_ids: list[str]  # [num_rows]
    statuses: list[TrajectoryStatus]  # [num_rows]
    sample_index: list[int]  # [num_rows]
    num_tokens: list[int]  # [num_rows] prompt + response
    rewards: list[float]  # [num_rows]
    min_policy_versions: list[int]  # [num_rows]
    attempts: list[int] | None = None  # [num_rows]; None: all 0


def kept_rows(trajectory_ids: list[str], statuses: list[str], attempts: list[int] | None = None) -> list[int]:
    """Indices (ascending) of the row the buffer keeps of each trajectory in a log's rows, given in
    log order: rows of an attempt older than the trajectory's newest so far are skipped; of the
    others, its first finished or failed row, else its last (partial) row."""
    kept: dict[str, int] = {}
    final: set[str] = set()
    current: dict[str, int] = {}
    partial = TrajectoryStatus.PARTIAL.value
    for i, (tid, status) in enumerate(zip(trajectory_ids, statuses)):
        attempt = attempts[i] if attempts is not None else 0
        if tid in final or attempt < current.get(tid, 0):
            continue
        current[tid] = attempt
        kept[tid] = i
        if status != partial:
            final.add(tid)
    return sorted(kept.values())


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
        self.num_stale_attempt_rows = 0  # rows refused for an attempt older than their trajectory's current one
        self.num_partial = 0
        self.num_accepted = 0  # finished trajectories kept for training (READY or CONSUMED groups)
        self.num_in_flight = 0  # members of OPEN groups, finished or not: admitted, not yet accepted
        self.generated_lengths: Counter[int] = Counter()  # length bucket -> finished members of settled groups
        self.num_trained = 0  # finished members of groups the learner has used at least once
        self.settled: list[GroupState] = []  # every group that left OPEN, in the order it did

    def check_overflow(self, trajectory_ids: list[str], group_ids: list[str]) -> None:
        """Raise ValueError before any mutation if these rows' new trajectories overflow a group."""
        known_trajectories = self.trajectories
        new_per_group: dict[str, set[str]] = {}
        for tid, gid in zip(trajectory_ids, group_ids):
            if tid not in known_trajectories:
                tids = new_per_group.get(gid)
                if tids is None:
                    new_per_group[gid] = {tid}
                else:
                    tids.add(tid)
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

    def num_new_trajectories(self, trajectory_ids: list[str], group_ids: list[str]) -> int:
        """The live rows that applying these rows adds: one per trajectory not held yet whose group is
        new or open. A row that replaces a partial row, a refused row and a late row add none."""
        new: set[str] = set()
        for tid, gid in zip(trajectory_ids, group_ids):
            if tid not in self.trajectories and tid not in new:
                group = self.groups.get(gid)
                if group is None or group.phase is GroupPhase.OPEN:
                    new.add(tid)
        return len(new)

    def apply(self, rows: RowColumns) -> list[int]:
        """Apply rows in order; returns ids of rows that died (superseded, late, or of a closed
        group). One tight loop per batch: this runs for every appended row."""
        dead: list[int] = []
        groups, trajectories, preloaded = self.groups, self.trajectories, self.preloaded_steps
        group_size, partial = self.group_size, TrajectoryStatus.PARTIAL
        attempts = rows.attempts if rows.attempts is not None else [0] * len(rows.trajectory_ids)
        columns = zip(
            rows.trajectory_ids,
            rows.group_ids,
            rows.statuses,
            rows.sample_index,
            rows.num_tokens,
            rows.rewards,
            rows.min_policy_versions,
            attempts,
        )
        for row, (tid, gid, status, sample_index, num_tokens, reward, min_pv, attempt) in enumerate(
            columns, rows.first_row
        ):
            group = trajectories.get(tid) or groups.get(gid)
            if group is None:
                group = groups[gid] = GroupState(group_id=gid)
                self.counts[GroupPhase.OPEN] += 1
            if group.phase is not GroupPhase.OPEN:
                self.num_late_rows += 1
                logger.warning("ignoring late row of trajectory %s: group %s is %s", tid, gid, group.phase)
                dead.append(row)
                continue
            old = group.members.get(tid)
            if old is not None and attempt < old.attempt:
                self.num_stale_attempt_rows += 1
                logger.warning(
                    "refusing %s row of trajectory %s: its attempt %d is older than the current attempt %d "
                    "(a worker the driver already replaced)",
                    status,
                    tid,
                    attempt,
                    old.attempt,
                )
                dead.append(row)
                continue
            if old is not None and old.status is not partial:
                self.num_late_rows += 1
                logger.warning("ignoring %s row of trajectory %s: its %s row is final", status, tid, old.status)
                dead.append(row)
                continue
            steps: list[int] = []
            if old is not None:
                dead.append(old.row)
                steps = old.consume_steps
                if old.status is partial:
                    self.num_partial -= 1
                    group.num_partial_members -= 1
            else:
                self.num_in_flight += 1
            if status is partial:
                self.num_partial += 1
                group.num_partial_members += 1
            group.members[tid] = TrajState(
                trajectory_id=tid,
                row=row,
                status=status,
                sample_index=sample_index,
                num_tokens=num_tokens,
                reward=reward,
                min_policy_version=min_pv,
                attempt=attempt,
                consume_steps=preloaded.pop(tid, steps) if preloaded else steps,
            )
            trajectories[tid] = group
            if group.num_partial_members == 0 and len(group.members) == group_size:
                dead.extend(self._settle(group))
        return dead

    def _settle(self, group: GroupState) -> list[int]:
        self.num_in_flight -= len(group.members)
        self.settled.append(group)
        finished: list[TrajState] = []
        failed_rows: list[int] = []
        for m in group.members.values():
            if m.status is TrajectoryStatus.FINISHED:
                finished.append(m)
            else:
                failed_rows.append(m.row)
        if len(finished) < self.min_finished:
            return self._close(group, GroupPhase.DROPPED)
        finished.sort(key=_sample_index)
        self.generated_lengths.update(length_bucket(m.num_tokens) for m in finished)
        rewards = [m.reward for m in finished]
        if self.filter_uniform and max(rewards) == min(rewards):
            return self._close(group, GroupPhase.FILTERED)
        group.finished = finished
        group.min_policy_version = min(
            [m.min_policy_version for m in finished if m.min_policy_version >= 0], default=OBSERVATION_VERSION
        )
        group.num_tokens = sum([m.num_tokens for m in finished])
        mean = sum(rewards) / len(rewards)
        group.reward_std = (sum([(r - mean) ** 2 for r in rewards]) / len(rewards)) ** 0.5
        group.num_uses = max([len(m.consume_steps) for m in finished])
        self.num_accepted += len(finished)
        if group.num_uses:
            self.num_trained += len(finished)
        if group.num_uses >= self.reuse:  # consumed before a restart: every member's row dies
            return self._close(group, GroupPhase.CONSUMED)
        self._move(group, GroupPhase.READY)
        self.ready[group.group_id] = group
        return failed_rows

    def kept_share(self, window: int) -> float:
        """(kept + 1) / (settled + 1) over the last `window` settled groups: the expected share of an
        in-flight group's trajectories the learner will consume (`admission = "expected"`). Kept means
        not dropped or DAPO-filtered when it settled; 1.0 before any group settles, never 0."""
        recent = self.settled[-window:]
        kept = sum(1 for g in recent if g.phase not in (GroupPhase.FILTERED, GroupPhase.DROPPED))
        return (kept + 1) / (len(recent) + 1)

    def consume(self, group: GroupState, learner_step: int) -> list[int]:
        """Record one use of a READY group at `learner_step`; returns rows that died."""
        assert group.phase is GroupPhase.READY, f"consuming group {group.group_id} in phase {group.phase}"
        for m in group.finished:
            m.consume_steps.append(learner_step)
        group.num_uses += 1
        if group.num_uses == 1:
            self.num_trained += len(group.finished)
        if group.num_uses >= self.reuse:
            return self._close(group, GroupPhase.CONSUMED)
        self.ready.pop(group.group_id)
        self.ready[group.group_id] = group  # back of the FIFO for its next use
        return []

    def retire(self, group: GroupState, phase: GroupPhase) -> list[int]:
        """Take a READY group out of sampling: EVICTED (over-age) and DROPPED (unusable rows) free its
        rows, OVER_AGE keeps them."""
        assert phase in (GroupPhase.EVICTED, GroupPhase.OVER_AGE, GroupPhase.DROPPED)
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

    def _resumable(self) -> list[TrajState]:
        return [
            m
            for g in self.groups.values()
            if g.phase is GroupPhase.OPEN
            for m in g.members.values()
            if m.status is TrajectoryStatus.PARTIAL
        ]

    def resumable_rows(self, trajectory_ids: list[str] | None = None) -> list[int]:
        if trajectory_ids is None:
            return [m.row for m in self._resumable()]
        out = []
        for tid in trajectory_ids:
            group = self.trajectories.get(tid)
            m = group.members.get(tid) if group is not None and group.phase is GroupPhase.OPEN else None
            if m is not None and m.status is TrajectoryStatus.PARTIAL:
                out.append(m.row)
        return out

    def partial_attempt(self, trajectory_id: str) -> int | None:
        """The current attempt of a running trajectory (its latest row partial, its group open), else None."""
        group = self.trajectories.get(trajectory_id)
        m = group.members.get(trajectory_id) if group is not None and group.phase is GroupPhase.OPEN else None
        return m.attempt if m is not None and m.status is TrajectoryStatus.PARTIAL else None

    def resumable_ids(self) -> list[str]:
        return [m.trajectory_id for m in self._resumable()]

    @property
    def num_ready_trajectories(self) -> int:
        return sum(len(g.finished) for g in self.ready.values())
