"""The component cost models the simulator runs on: plain numbers, fitted on this machine
(`sim.calibrate`) or taken from published measurements (`sim.published`).

- `EngineCost`: one engine with continuous batching. Every running request gets one token per decode
  step and a step takes `step_s(b, ctx) = base_s + per_seq_s * b + per_seq_ctx_s * b * ctx`
  (+ `shared_s` while the learner trains on the same cores, this machine only); each request first
  pays `request_s` (prefill, scheduling, the call itself). Throughput is `b / step_s(b, ctx)`.
- `ToolLatency`: the environment's reply time per assistant turn, lognormal from its median and p99
  (the latency environment of bench/async_vs_sync.py draws the same way).
- `AgentCost`: the agent loop's own work per turn, outside the engine call and the tool's wait
  (templating, parsing, the calls between worker, engine and environment).
- `TrajectoryShape`: assistant turns per trajectory (uniform), tokens per turn (quantiles, sampled
  by inverse CDF), prompt tokens.
- `LearnerCost`: `step_s = base_s + per_token_s * tokens`, times
  `1 + shared_frac * load + process_frac * extra` while engines decode on the same cores, `load`
  (0 to 1) the share of their decode step that is per-sequence work (`EngineCost.load`), `extra` the
  engine processes decoding beside the first (each its own scheduler loop and threads); `sample_s` to
  fetch a ready batch, `step_overhead_s` after each step.
- `SyncCost`: `total_s = base_s + bytes / bandwidth`; engines stop generating for
  `pause_base_s + pause_share * (total_s - base_s)` of it (0 for a transport that stages the weights
  while the engines serve, 1 for one that writes into the serving weights).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclass(frozen=True, slots=True)
class EngineCost:
    base_s: float  # per decode step, whatever the batch
    per_seq_s: float  # per running sequence per step
    per_seq_ctx_s: float = 0.0  # per sequence per context token per step (attention reads)
    request_s: float = 0.0  # per request (prefill, scheduling, the call)
    shared_s: float = 0.0  # added per step while the learner trains on the same cores
    max_batch: int = 256  # sequences decoded at once; the rest wait in the engine's queue

    def step_s(self, batch: int, ctx: float, learner_busy: bool = False) -> float:
        shared = self.shared_s if learner_busy else 0.0
        return self.base_s + batch * (self.per_seq_s + self.per_seq_ctx_s * ctx) + shared

    def tokens_per_s(self, batch: int, ctx: float) -> float:
        return batch / self.step_s(batch, ctx) if batch else 0.0

    def load(self, batch: float) -> float:
        """How much of the machine's cores `batch` decoding sequences take, 0 to 1: the per-sequence
        share of a decode step. The per-step rest is the scheduler's loop on one thread; the
        per-sequence work is the matrix products, on every core. One sequence barely slows a learner
        on the same cores, twenty nearly as much as a full machine does."""
        if batch <= 0:
            return 0.0
        if self.per_seq_s <= 0:
            return 1.0  # no per-sequence work told apart: any decoding is the full load
        work = self.per_seq_s * batch
        return work / (self.base_s + work)


@dataclass(frozen=True, slots=True)
class ToolLatency:
    median_s: float
    p99_s: float
    max_s: float = 0.0  # a tool timeout: draws are cut there (0: none)

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.median_s) / Z99 if self.median_s > 0 and self.p99_s > self.median_s else 0.0

    @property
    def mean_s(self) -> float:
        """The mean reply time (of the lognormal, cut at `max_s` when set)."""
        if self.median_s <= 0:
            return 0.0
        mu, sigma = math.log(self.median_s), self.sigma
        mean = math.exp(mu + sigma**2 / 2)
        if self.max_s <= 0 or sigma == 0:
            return mean if self.max_s <= 0 else min(self.median_s, self.max_s)

        def phi(x: float) -> float:
            return 0.5 * (1 + math.erf(x / math.sqrt(2)))

        z = (math.log(self.max_s) - mu) / sigma  # E[min(X, c)] for a lognormal X
        return mean * phi(z - sigma) + self.max_s * (1 - phi(z))

    def draw(self, rng: np.random.Generator, n: int | None = None) -> Any:
        if self.median_s <= 0:
            return 0.0 if n is None else np.zeros(n)
        draws = self.median_s * np.exp(rng.normal(0.0, self.sigma, n))
        return np.minimum(draws, self.max_s) if self.max_s > 0 else draws

    @classmethod
    def parse(cls, text: str) -> ToolLatency:
        """'p50=2s,p99=60s[,max=120s]' (units s or ms; 'p50=0,p99=0' for no latency; max: a timeout)."""
        parts = dict(p.split("=", 1) for p in text.replace(" ", "").split(",") if "=" in p)
        if not {"p50", "p99"} <= set(parts) <= {"p50", "p99", "max"}:
            raise ValueError(f"tool latency {text!r}: give p50=<t>,p99=<t>[,max=<t>], e.g. p50=2s,p99=60s")

        def seconds(v: str) -> float:
            v = v.lower()
            return float(v[:-2]) / 1000 if v.endswith("ms") else float(v.removesuffix("s"))

        median, p99, max_s = seconds(parts["p50"]), seconds(parts["p99"]), seconds(parts.get("max", "0"))
        # NaN passes every comparison below (and makes the simulator spin); inf is no latency to simulate
        if not all(math.isfinite(v) for v in (median, p99, max_s)):
            raise ValueError(f"tool latency {text!r}: every time must be a finite number of seconds")
        if median < 0 or p99 < median or max_s < 0:
            raise ValueError(f"tool latency {text!r}: need 0 <= p50 <= p99 and max >= 0")
        return cls(median, p99, max_s)


@dataclass(frozen=True, slots=True)
class AgentCost:
    turn_s: float = 0.0  # per assistant turn, after the environment's reply and before the next call


@dataclass(frozen=True, slots=True)
class TrajectoryShape:
    turn_probs: tuple[float, ...]  # chance of 1, 2, ... assistant turns (each followed by an env reply)
    turn_tokens: tuple[float, ...]  # quantiles (equally spaced, 0..1) of tokens sampled per turn
    prompt_tokens: float
    observation_tokens: float = 0.0  # tokens an environment reply adds to the context

    @classmethod
    def uniform_turns(cls, lo: int, hi: int, **kw: Any) -> TrajectoryShape:
        return cls(turn_probs=tuple([0.0] * (lo - 1) + [1.0 / (hi - lo + 1)] * (hi - lo + 1)), **kw)

    def draw_turns(self, rng: np.random.Generator, n: int) -> np.ndarray:
        cum = np.cumsum(self.turn_probs)
        return np.searchsorted(cum / cum[-1], rng.random(n), side="right") + 1

    @property
    def mean_turns(self) -> float:
        p = np.asarray(self.turn_probs, dtype=np.float64)
        return float(np.dot(p / p.sum(), np.arange(1, len(p) + 1)))

    def draw_tokens(self, rng: np.random.Generator, n: int) -> np.ndarray:
        q = np.asarray(self.turn_tokens, dtype=np.float64)
        return np.maximum(np.rint(np.interp(rng.random(n), np.linspace(0, 1, len(q)), q)), 1).astype(np.int64)

    @property
    def mean_turn_tokens(self) -> float:
        q = np.asarray(self.turn_tokens, dtype=np.float64)
        return float(np.trapezoid(q, np.linspace(0, 1, len(q))))


@dataclass(frozen=True, slots=True)
class LearnerCost:
    base_s: float
    per_token_s: float  # per trained token (prompt + response)
    shared_frac: float = 0.0  # slow-down at full engine load on the same cores (this machine)
    step_overhead_s: float = 0.0  # per step outside train and sync (logging, the driver's calls)
    sample_s: float = 0.0  # fetching a ready batch (the driver counts it as learner idle)
    process_frac: float = 0.0  # slow-down per engine process decoding beside the first on the same cores

    def step_s(self, tokens: int, load: float = 0.0) -> float:
        """`load`: the engines' load on the learner's cores (`EngineCost.load`), 0 to 1."""
        return (self.base_s + self.per_token_s * tokens) * self.slowdown(load)

    def slowdown(self, load: float, extra_processes: int = 0) -> float:
        """How many times longer training takes while engines load its cores by `load` (0 to 1), with
        `extra_processes` engine processes decoding there beside the first."""
        return 1 + self.shared_frac * load + self.process_frac * extra_processes


@dataclass(frozen=True, slots=True)
class SyncCost:
    base_s: float
    bytes: float = 0.0
    bandwidth_Bps: float = 1.0  # bytes per second of the transport (unused while bytes = 0)
    pause_base_s: float = 0.0
    pause_share: float = 0.0

    @property
    def total_s(self) -> float:
        return self.base_s + (self.bytes / self.bandwidth_Bps if self.bytes else 0.0)

    @property
    def pause_s(self) -> float:
        return self.pause_base_s + self.pause_share * (self.total_s - self.base_s)


@dataclass(frozen=True, slots=True)
class Costs:
    """Everything the simulator needs besides the pipeline's own settings (`sim.pipeline.SimConfig`)."""

    engine: EngineCost
    tool: ToolLatency
    shape: TrajectoryShape
    learner: LearnerCost
    sync: SyncCost
    agent: AgentCost = AgentCost()  # 0 for the published costs: tool waits of seconds dwarf it there
    source: dict[str, Any] = field(default_factory=dict)  # where each number came from

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Costs:
        shape = data["shape"]
        return cls(
            engine=EngineCost(**data["engine"]),
            tool=ToolLatency(**data["tool"]),
            shape=TrajectoryShape(
                turn_probs=tuple(shape["turn_probs"]),
                turn_tokens=tuple(shape["turn_tokens"]),
                prompt_tokens=float(shape["prompt_tokens"]),
                observation_tokens=float(shape["observation_tokens"]),
            ),
            learner=LearnerCost(**data["learner"]),
            sync=SyncCost(**data["sync"]),
            agent=AgentCost(**data.get("agent", {})),
            source=dict(data.get("source", {})),
        )
