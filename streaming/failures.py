"""Stop a run whose trajectories (nearly) all fail, instead of consuming the whole dataset.

A failed trajectory (a prompt longer than `rollout.agent.prompt_length`, a reward function that
raises, ...) still appends a row, so the learner's stall check sees progress; its group is dropped
(too few finished members), admission frees room for the next prompt, and without this check a run
whose every trajectory fails walks through every epoch of prompts at learner step 0 and ends "cleanly".

The driver's health check polls each rollout worker's `RolloutOutcomes` (counters since the worker
started) and feeds the increments to a `FailureWindow`: over the last `trainer.failed_window`
terminal trajectories (finished or failed, at the granularity of one poll), a failed share above
`trainer.max_failed_fraction` raises `TooManyFailedTrajectories`, naming the most common reasons the
workers counted.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray

from streamrl.streaming.errors import StreamRLError

if TYPE_CHECKING:
    from streamrl.rollout.types import RolloutOutcomes
    from streamrl.streaming.pipeline import Pipeline


class TooManyFailedTrajectories(StreamRLError):
    """The share of failed trajectories over the recent window passed `trainer.max_failed_fraction`."""


def too_many_failed(num_finished: int, num_failed: int, *, window: int, max_fraction: float) -> bool:
    """True when at least `window` trajectories are counted and more than `max_fraction` of them failed."""
    total = num_finished + num_failed
    return total >= window and num_failed > max_fraction * total


@dataclass(kw_only=True)
class FailureWindow:
    """Sliding count of the newest terminal trajectories over all workers (pure bookkeeping).

    `observe` takes a worker's cumulative counters; a replaced worker comes with a new id and
    counts from zero. The window keeps the newest increments whose sum reaches `window` (one
    increment may overshoot it: a poll is the granularity)."""

    window: int
    max_fraction: float
    _seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker id -> (finished, failed) last seen
    _reasons: dict[str, dict[str, int]] = field(default_factory=dict)  # worker id -> its failure reasons
    _increments: deque[tuple[int, int]] = field(default_factory=deque)  # (finished, failed), oldest first
    num_finished: int = 0  # in the window
    num_failed: int = 0  # in the window

    def observe(self, outcomes: RolloutOutcomes) -> None:
        finished0, failed0 = self._seen.get(outcomes.worker_id, (0, 0))
        finished, failed = max(outcomes.num_finished - finished0, 0), max(outcomes.num_failed - failed0, 0)
        self._seen[outcomes.worker_id] = (outcomes.num_finished, outcomes.num_failed)
        self._reasons[outcomes.worker_id] = dict(outcomes.failure_reasons)
        if finished == failed == 0:
            return
        self._increments.append((finished, failed))
        self.num_finished += finished
        self.num_failed += failed
        while len(self._increments) > 1:  # drop the oldest while the rest still fill the window
            old_finished, old_failed = self._increments[0]
            if self.num_finished + self.num_failed - old_finished - old_failed < self.window:
                break
            self._increments.popleft()
            self.num_finished -= old_finished
            self.num_failed -= old_failed

    @property
    def tripped(self) -> bool:
        return too_many_failed(self.num_finished, self.num_failed, window=self.window, max_fraction=self.max_fraction)

    def reasons(self) -> Counter[str]:
        """Failures by reason over the run, every worker ever seen."""
        total: Counter[str] = Counter()
        for reasons in self._reasons.values():
            total.update(reasons)
        return total

    def message(self, learner_step: int) -> str:
        total = self.num_finished + self.num_failed
        top = self.reasons().most_common(3)
        why = "; ".join(f"{n}x {reason}" for reason, n in top) if top else "no reason was recorded"
        return (
            f"the run stopped at learner step {learner_step}: {self.num_failed} of the last {total} trajectories "
            f"failed (more than trainer.max_failed_fraction={self.max_fraction:g} over trainer.failed_window="
            f"{self.window}). Most common failure: {why}. Every failed trajectory's traceback is in RUN_DIR/logs"
        )


async def check_failures(pipeline: Pipeline, *, final: bool = False) -> None:
    """Poll the workers' outcomes into `pipeline.failures` and raise `TooManyFailedTrajectories` when the
    window trips; `final` (a run that ran out of prompts early) judges whatever was counted, even
    fewer than `failed_window` trajectories. A worker that does not answer is skipped (the health
    check replaces dead ones)."""
    cfg = pipeline.cfg.trainer
    if pipeline.failures is None:
        pipeline.failures = FailureWindow(window=cfg.failed_window, max_fraction=cfg.max_failed_fraction)
    for worker in pipeline.workers:
        try:
            pipeline.failures.observe(await worker.outcomes())
        except (TimeoutError, ray.exceptions.RayActorError):
            continue
    window = pipeline.failures
    if window.tripped or (
        final and too_many_failed(window.num_finished, window.num_failed, window=1, max_fraction=window.max_fraction)
    ):
        raise TooManyFailedTrajectories(pipeline.failures.message(pipeline.state.learner_step))


def no_steps_message(total_steps: int) -> str:
    """Why `streamrl train` exits non-zero after a run that trained nothing."""
    return (
        f"the run ended at learner step 0 of {total_steps}: the prompts ran out before one batch was complete "
        "(failed trajectories and filtered groups are not trained); see RUN_DIR/logs"
    )
