"""RolloutWorker: runs many agent loops concurrently and is the pause/resume point of weight sync.

Consumes `AgentData` (new trajectories from the driver, or partial ones to resume), produces
`Trajectory` rows into `sink` (the buffer). Interrupt protocol, worker side:

- `pause()` sets the cancel Event. Loops in GENERATING abort their engine request, keep the streamed
  tokens and park; their partial rows are in the sink before `pause()` returns. Loops running tools or
  interactions keep going (tools do not depend on weights) and park when they next need the engine.
  New submissions are held until `resume()`.
- `resume()` clears the Event and relaunches every parked trajectory from its AgentData.

With a distillation teacher (`teacher`), a finished trajectory is scored by the teacher before its
row goes to the sink (`rollout.teacher`); the teacher never pauses, so scoring goes on during a sync.

A trajectory belongs to exactly one place at every moment (I2): its task in `_tasks` from submission
until its row is in the sink (a parking loop included, while its partial row is being saved), then
— if it parked — `_held` while paused, or a new task at once if `resume()` came meanwhile. Counters
(`num_finished`, ...) move only once the sink accepted the row. A sink that refuses a row
(backpressure: it returns False) is retried; one that raises is a worker fault that `check()` raises.

In `keep` pause mode the worker does not cancel anything: the engine freezes its requests in place and
the loops never notice (vLLM keep-mode pause); only admissions are held.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import traceback
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from streamrl.core import trace
from streamrl.core.aio import gather_within
from streamrl.engines.base import PauseMode
from streamrl.rollout.agent_loop import AgentContext, get_agent_loop_cls
from streamrl.rollout.gateway.loop import gateway_metrics
from streamrl.rollout.types import AgentData, AgentState, FinishReason, RolloutOutcomes, Trajectory, TrajectoryStatus

if TYPE_CHECKING:
    from streamrl.rollout.teacher import TeacherScorer

logger = logging.getLogger(__name__)

# Returns False when the row was not accepted (yet): the worker retries. None/True = accepted.
Sink = Callable[[Trajectory], Awaitable[bool | None]]

# A worker lives as long as the run: it keeps the newest failure texts (with tracebacks) and counts
# failures by reason, both bounded, instead of every error string it ever saw.
MAX_KEPT_ERRORS = 64
MAX_REASONS = 32  # distinct failure reasons counted; later new ones are counted under "other"
_DIGITS = re.compile(r"\d+")


def failure_reason(exc: BaseException) -> str:
    """What a failure counts under: the exception's type and the first line of its message, numbers
    as N (so "prompt of 612 tokens" and "prompt of 700 tokens" are one reason), at most 200 chars."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return _DIGITS.sub("N", f"{type(exc).__name__}: {first}" if first else type(exc).__name__)[:200]


class RolloutWorker:
    def __init__(
        self,
        ctx: AgentContext,
        sink: Sink,
        *,
        max_concurrent: int = 32,
        pause_mode: PauseMode = PauseMode.ABORT,
        worker_id: str = "worker-0",
        sink_retry_s: float = 0.5,
        teacher: TeacherScorer | None = None,
    ) -> None:
        self.ctx = ctx
        self.sink = sink
        self.teacher = teacher  # scores each finished trajectory before its row is written (distillation)
        self.worker_id = worker_id
        self.pause_mode = pause_mode
        self._slots = asyncio.Semaphore(max_concurrent)
        self._tasks: dict[str, asyncio.Task] = {}
        self._states: dict[str, AgentData] = {}
        self._active: set[str] = set()  # holding a concurrency slot
        self._held: list[AgentData] = []  # submitted or parked while paused
        self._parked_at: dict[str, float] = {}  # trajectory id -> wall time it parked (traced runs only)
        self._paused = False
        self._paused_epoch = -1  # newest sync epoch whose pause started here
        self._resumed_epoch = -1  # newest sync epoch whose resume was applied
        self._num_sinking = 0
        self.sink_retry_s = sink_retry_s
        self.num_sink_retries = 0
        self._faults: list[BaseException] = []  # sink failures: surfaced by check()
        self.num_finished = 0
        self.num_partial = 0
        self.num_failed = 0
        self.num_resumed = 0
        self.reward_sum = 0.0  # over finished trajectories
        self.turns_sum = 0  # over finished trajectories
        self.tool_calls_sum = 0  # over finished trajectories
        self.errors: deque[str] = deque(maxlen=MAX_KEPT_ERRORS)  # newest failures, with tracebacks
        self.num_errors = 0  # every failure, also those no longer in `errors`
        self.failure_reasons: Counter[str] = Counter()  # failure_reason -> count (MAX_REASONS kinds)

    # ---- submission ---------------------------------------------------------------------------

    def submit(self, data: AgentData) -> bool:
        """Start (or resume) one trajectory; held until `resume()` while paused.

        Idempotent: a trajectory already running or held here is not started twice (the driver may
        resubmit orphans from the buffer while a copy is already on its way); returns False then."""
        tid = data.trajectory_id
        if tid in self._tasks or any(h.trajectory_id == tid for h in self._held):
            logger.info("%s: trajectory %s is already here; duplicate submission dropped", self.worker_id, tid)
            return False
        if self._paused:
            self._held.append(data)
            return True
        if data.state is not AgentState.PENDING:
            self.num_resumed += 1
            self._trace_resumed(data)
        self._states[tid] = data
        self._tasks[tid] = asyncio.create_task(self._drive(data), name=tid)
        return True

    async def _drive(self, data: AgentData) -> None:
        tid = data.trajectory_id
        sinking = False
        queued_at = time.time()
        try:
            async with self._slots:
                trace.complete("queued", "trajectory", tid, queued_at, attempt=data.attempt, worker=self.worker_id)
                self._active.add(tid)
                data.agent_name = data.agent_name or self.ctx.cfg.default_agent
                loop = get_agent_loop_cls(data.agent_name)(self.ctx)
                try:
                    traj = await loop.run(data)
                    if self.teacher is not None and traj.status is TrajectoryStatus.FINISHED:
                        traj = await self.teacher.score(traj)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # fault boundary: one bad trajectory must not stop the worker
                    logger.warning("trajectory %s failed: %s", tid, exc)
                    self._record_error(tid, exc)
                    data.finish_reason = FinishReason.ERROR
                    traj = data.to_trajectory(TrajectoryStatus.FAILED, image_token_id=self.ctx.image_token_id)
                finally:
                    self._active.discard(tid)
                self._num_sinking += 1
                sinking = True
            await self._deliver(traj)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the sink failed for good: the row is not saved; a worker fault
            logger.error("%s: could not save trajectory %s: %r", self.worker_id, tid, exc)
            self._faults.append(exc)
            return
        finally:
            if sinking:
                self._num_sinking -= 1
            if self._tasks.get(tid) is asyncio.current_task():
                del self._tasks[tid]
                self._states.pop(tid, None)
        self._count(traj)
        if traj.status is TrajectoryStatus.PARTIAL:
            if trace.enabled():
                self._parked_at[tid] = time.time()
            self._park(data)  # the same record its partial row was made from (JSON only at the Arrow edge)

    async def _deliver(self, traj: Trajectory, max_errors: int = 5) -> None:
        """Hand the row to the sink until it is accepted: backpressure (False) is retried for as long
        as it lasts, an exception up to `max_errors` times in a row (with growing pauses)."""
        errors = 0
        while True:
            try:
                if (await self.sink(traj)) is not False:
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                errors += 1
                if errors >= max_errors:
                    raise
            self.num_sink_retries += 1
            await asyncio.sleep(self.sink_retry_s * (2**errors))

    def _trace_resumed(self, data: AgentData) -> None:
        """The lifecycle trace: the `parked` span (from its partial row saved here to now) and the
        `resumed` instant; a trajectory parked by another worker (that died) gets the instant only."""
        tid = data.trajectory_id
        parked_at = self._parked_at.pop(tid, None)
        if parked_at is not None:
            trace.complete("parked", "trajectory", tid, parked_at, attempt=data.attempt, worker=self.worker_id)
        trace.instant("resumed", "trajectory", tid, attempt=data.attempt, worker=self.worker_id)

    def _record_error(self, tid: str, exc: BaseException) -> None:
        self.errors.append(f"{tid}: {exc!r}\n{traceback.format_exc(limit=3)}")
        self.num_errors += 1
        reason = failure_reason(exc)
        if reason not in self.failure_reasons and len(self.failure_reasons) >= MAX_REASONS:
            reason = "other"
        self.failure_reasons[reason] += 1

    def _count(self, traj: Trajectory) -> None:
        if traj.status is TrajectoryStatus.PARTIAL:
            self.num_partial += 1
        elif traj.status is TrajectoryStatus.FINISHED:
            self.num_finished += 1
            self.reward_sum += traj.reward
            self.turns_sum += traj.num_turns
            self.tool_calls_sum += traj.num_tool_calls
        else:
            self.num_failed += 1

    def _park(self, data: AgentData) -> None:
        """A parked trajectory (its partial row saved) waits for `resume()`, or goes on at once if
        the resume already happened while its row was being saved."""
        if self._paused:
            self._held.append(data)
        else:
            self.submit(data)

    # ---- interrupt protocol -------------------------------------------------------------------

    async def pause(self, timeout_s: float = 60.0, epoch: int | None = None) -> None:
        """Hold admissions and (abort mode) park every loop that uses the engine; see module doc.

        `epoch` is the weight sync's fencing token (as for engines, `engines.base.SyncFence`):
        a remote pause that timed out at the coordinator still runs here, possibly after its resume.
        A pause not newer than an applied resume is ignored, and one overtaken by its resume while
        parking stops waiting, so a late pause never leaves the worker holding its trajectories."""
        if epoch is not None:
            if epoch <= self._resumed_epoch or epoch < self._paused_epoch:
                logger.warning(
                    "%s: ignoring stale pause of sync epoch %d (newest pause %d, resume %d)",
                    self.worker_id,
                    epoch,
                    self._paused_epoch,
                    self._resumed_epoch,
                )
                return
            self._paused_epoch = epoch
        self._paused = True
        if self.pause_mode is PauseMode.KEEP:
            return
        self.ctx.cancel.set()
        deadline = time.monotonic() + timeout_s
        while self.ctx.num_in_engine > 0 or self._num_sinking > 0 or self._num_about_to_generate() > 0:
            if epoch is not None and self._resumed_epoch >= epoch:
                return  # its resume came first: serving again
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.worker_id}: {self.ctx.num_in_engine} generations did not park within {timeout_s}s"
                )
            await asyncio.sleep(0.005)

    def _num_about_to_generate(self) -> int:
        """Running loops that will enter (or are in) GENERATING without first running a tool."""
        return sum(1 for tid in self._active if self._states[tid].state in (AgentState.PENDING, AgentState.GENERATING))

    async def resume(self, epoch: int | None = None) -> None:
        """Serve again: relaunch parked trajectories from their AgentData, then held submissions.
        A resume older than the pause in force (a late one from an earlier sync) is ignored."""
        if epoch is not None:
            if epoch < self._paused_epoch:
                logger.warning(
                    "%s: ignoring stale resume of sync epoch %d (pause %d in force)",
                    self.worker_id,
                    epoch,
                    self._paused_epoch,
                )
                return
            self._resumed_epoch = max(self._resumed_epoch, epoch)
        self.ctx.cancel.clear()
        self._paused = False
        held, self._held = self._held, []
        for data in held:
            self.submit(data)

    # ---- introspection ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def running_ids(self) -> list[str]:
        """Every trajectory this worker owns: running (incl. saving its row) or held."""
        return list(self._tasks) + [d.trajectory_id for d in self._held]

    def image_shas(self) -> set[str]:
        """Images of every trajectory this worker holds (running, saving its row, or held): an
        LRU-bounded image store keeps them (`ImageStore.pinned`), their rows still carry the bytes."""
        from streamrl.rollout.agent_loop.image_prompt import image_part_refs

        shas: set[str] = set()
        for data in [*self._states.values(), *self._held]:
            shas.update(ref.sha256 for ref in data.images)
            shas.update(image_part_refs(data.messages))
        return shas

    def outcomes(self) -> RolloutOutcomes:
        """Finished and failed trajectories so far, failures by reason (the driver's failure check)."""
        return RolloutOutcomes(
            worker_id=self.worker_id,
            num_finished=self.num_finished,
            num_failed=self.num_failed,
            failure_reasons=dict(self.failure_reasons),
        )

    def check(self) -> None:
        """Surface a crashed background task or a failed sink (a fault, not a failed trajectory)."""
        if self._faults:
            raise RuntimeError(f"{self.worker_id}: a trajectory could not be saved") from self._faults[0]
        for task in list(self._tasks.values()):
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"{self.worker_id}: agent loop task crashed") from task.exception()

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait until no trajectory is running (held ones excluded)."""
        tasks = list(self._tasks.values())
        if tasks:
            await gather_within(tasks, timeout_s, return_exceptions=True)

    async def shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        # the trace's `parked` span is written when the park ends: one still parked ends with the run
        for tid, parked_at in self._parked_at.items():
            trace.complete("parked", "trajectory", tid, parked_at, worker=self.worker_id, ended="shutdown")
        self._parked_at.clear()

    def metrics(self) -> dict[str, float]:
        c = self.ctx.counters
        return {
            "rollout/num_running": self.num_running,
            "rollout/num_held": self.num_held,
            "rollout/num_finished": self.num_finished,
            "rollout/num_partial": self.num_partial,
            "rollout/num_failed": self.num_failed,
            "rollout/num_resumed": self.num_resumed,
            "rollout/num_sink_retries": self.num_sink_retries,
            "rollout/reward_sum": self.reward_sum,
            "rollout/turns_sum": self.turns_sum,
            "rollout/tool_calls_sum": self.tool_calls_sum,
            "rollout/num_interrupts": c.num_interrupts,
            "rollout/num_parse_errors": c.num_parse_errors,
            "rollout/num_tool_calls": c.num_tool_calls,
            "rollout/num_tool_errors": c.num_tool_errors,
            "rollout/num_tool_calls_interrupted": c.num_tool_calls_interrupted,
            "rollout/num_generated_tokens": c.num_generated_tokens,
            "rollout/num_reprefill_tokens": c.num_reprefill_tokens,
            "rollout/num_progress_rows": c.num_progress_rows,
            "rollout/num_progress_cuts": c.num_progress_cuts,
            **self.ctx.server.stats().metrics(),
            **(self.ctx.tools.metrics() if self.ctx.tools is not None else {}),
            **gateway_metrics(self.ctx),
            **(self.teacher.metrics() if self.teacher is not None else {}),
        }
