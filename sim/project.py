"""Projections to large clusters: a model, a GPU count, an engine share of the GPUs, a tool latency;
the simulated throughput, busy and idle shares, lag and sync pause share.

A cluster of E engines is simulated as a slice of at most `MAX_SLICE_ENGINES` engines with the
batch, the learner GPUs and the concurrency cut by the same factor, and the throughput scaled back.
Every time in the slice is the full cluster's (a learner step trains 1/k of the batch on 1/k of the
GPUs; a sync moves the same bytes), except the extremes: the slowest of a smaller batch is less slow,
so a sync round's long tail is slightly underestimated (the slice keeps >= 128 trajectories a step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from streamrl.buffer.config import BufferConfig
from streamrl.sim.costs import ToolLatency, TrajectoryShape
from streamrl.sim.pipeline import SimConfig, simulate
from streamrl.sim.published import ModelSpec, cluster_costs

MAX_SLICE_ENGINES = 8
MIN_SLICE_BATCH = 128
GROUP_SIZE = 16
BATCH_PER_GPU = 32  # trajectories per learner step per GPU of the cluster (512 prompts x 16 at 256 GPUs)


@dataclass(frozen=True, slots=True)
class Projection:
    model: str
    gpus: int
    engine_gpus: int
    learner_gpus: int
    mode: str
    max_staleness: int
    sync_every: int
    overlap: bool
    samples_per_hour: float
    tokens_per_s_per_gpu: float  # trained tokens
    engine_busy: float
    learner_idle: float
    lag_mean: float
    lag_hist: dict[str, float]
    sync_pause_share: float
    step_s: float

    def row(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def split_gpus(model: ModelSpec, gpus: int, engine_share: float) -> tuple[int, int]:
    """Engine GPUs (whole engines) and learner GPUs for a share of the cluster."""
    engines = max(int(round(gpus * engine_share / model.engine_gpus)), 1)
    engine_gpus = min(engines * model.engine_gpus, gpus - model.engine_gpus)
    return engine_gpus, gpus - engine_gpus


def project(
    model: ModelSpec,
    *,
    gpus: int,
    engine_share: float,
    tool: ToolLatency,
    mode: Literal["async", "sync", "colocated"] = "async",
    max_staleness: int = 4,
    sync_every: int = 1,
    overlap: bool = True,
    shape: TrajectoryShape | None = None,
    steps: int = 12,
    seed: int = 0,
    batch: int | None = None,
) -> Projection:
    """One simulated cluster. `colocated`: the synchronous baseline of verl/AReaL's comparisons, every
    GPU generates then trains (sync mode with all GPUs as engines and as learner: the phases never overlap)."""
    engine_gpus, learner_gpus = (gpus, gpus) if mode == "colocated" else split_gpus(model, gpus, engine_share)
    engines = engine_gpus // model.engine_gpus
    batch = batch or BATCH_PER_GPU * gpus
    k = max(1.0, min(engines / MAX_SLICE_ENGINES, batch / MIN_SLICE_BATCH))
    slice_engines = max(int(round(engines / k)), 1)
    k = engines / slice_engines
    slice_batch = max(int(round(batch / k / GROUP_SIZE)), 1) * GROUP_SIZE
    costs = cluster_costs(model, learner_gpus=learner_gpus / k, tool=tool, shape=shape, overlap=overlap)
    cfg = SimConfig(
        buffer=BufferConfig(batch_size=slice_batch, group_size=GROUP_SIZE, max_staleness=max_staleness),
        mode="async" if mode == "async" else "sync",
        num_engines=slice_engines,
        max_concurrent=slice_engines * costs.engine.max_batch * 4,
        sync_every=sync_every,
        total_steps=steps,
        seed=seed,
        warmup_steps=steps // 3,
    )
    r = simulate(cfg, costs)
    mean_tokens = costs.shape.prompt_tokens + costs.shape.mean_turns * (
        costs.shape.mean_turn_tokens + costs.shape.observation_tokens
    )
    samples = r.trained_samples_per_hour * k
    return Projection(
        model=model.name,
        gpus=gpus,
        engine_gpus=engine_gpus,
        learner_gpus=learner_gpus,
        mode=mode,
        max_staleness=max_staleness if mode == "async" else 0,
        sync_every=sync_every,
        overlap=overlap,
        samples_per_hour=samples,
        tokens_per_s_per_gpu=samples * mean_tokens / 3600 / gpus,
        engine_busy=r.engine_busy_fraction,
        learner_idle=r.learner_idle_fraction,
        lag_mean=r.lag_mean,
        lag_hist=r.lag_hist,
        sync_pause_share=r.sync_pause_share,
        step_s=r.step_s,
    )


SHARES = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


def best_split(model: ModelSpec, **kw: Any) -> tuple[Projection, list[Projection]]:
    """The engine share with the highest throughput among `SHARES`, and every one tried."""
    tried = [project(model, engine_share=s, **kw) for s in SHARES]
    return max(tried, key=lambda p: p.samples_per_hour), tried


def async_over_sync(model: ModelSpec, **kw: Any) -> dict[str, Any]:
    """Async at its best split against sync at its own best split and against colocated sync."""
    a, _ = best_split(model, mode="async", **kw)
    s, _ = best_split(model, mode="sync", **kw)
    c = project(model, engine_share=1.0, mode="colocated", **kw)
    return {
        "async": a.row(),
        "sync": s.row(),
        "colocated": c.row(),
        "async_over_sync": a.samples_per_hour / s.samples_per_hour,
        "async_over_colocated": a.samples_per_hour / c.samples_per_hour,
    }
