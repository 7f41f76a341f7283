"""`streamrl plan`: the engine:learner split a cluster should use for a model and a tool latency, and
the expected time to a reward, async against sync.

Throughput, engine busy share, lag and step time come from the simulator with published component
costs (`sim.published`). What the lag costs in learning comes from the staleness lab
(`sim.lag_cost`): steps to a reward for the simulated lag mix, against lag 0 for sync. Time to the
reward = those steps x the simulated step time, so the headline ratio is the throughput ratio times
the learning cost of async's lag. docs/simulator.md says what is assumed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from streamrl.sim.costs import ToolLatency
from streamrl.sim.lag_cost import LagCost, lag_shares, load_lag_cost
from streamrl.sim.project import SHARES, project
from streamrl.sim.published import MODELS


def plan(
    model: str,
    gpus: int,
    tool: ToolLatency,
    *,
    max_staleness: int = 4,
    sync_every: int = 1,
    overlap: bool = True,
    steps: int = 12,
    shares: tuple[float, ...] = SHARES,
    batch: int | None = None,
    correction: str = "decoupled",
    lag_cost: LagCost | None = None,
) -> dict[str, Any]:
    """Async at every engine share of `shares`; the best one, and the synchronous baselines (disaggregated
    at the same split, and colocated) for the async/sync ratio."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: one of {', '.join(MODELS)}")
    if steps < 1 or sync_every < 1 or max_staleness < 0 or (batch is not None and batch < 1):
        raise ValueError(
            f"need steps >= 1, sync_every >= 1, max_staleness >= 0 and batch >= 1 (got steps={steps}, "
            f"sync_every={sync_every}, max_staleness={max_staleness}, batch={batch})"
        )
    spec = MODELS[model]
    if gpus < 2 * spec.engine_gpus:
        raise ValueError(
            f"{gpus} GPUs: a {model} engine takes {spec.engine_gpus}; give at least {2 * spec.engine_gpus}"
        )
    kw: dict[str, Any] = dict(gpus=gpus, tool=tool, sync_every=sync_every, overlap=overlap, steps=steps, batch=batch)
    tried = [project(spec, engine_share=s, mode="async", max_staleness=max_staleness, **kw) for s in shares]
    best = max(tried, key=lambda p: p.samples_per_hour)
    share = best.engine_gpus / gpus
    sync = project(spec, engine_share=share, mode="sync", **kw)
    colocated = project(spec, engine_share=1.0, mode="colocated", **kw)
    cost = lag_cost or load_lag_cost(correction)
    reach = {name: time_to_reward(p.row(), cost, max_staleness) for name, p in (("async", best), ("sync", sync))}
    reach["colocated"] = time_to_reward(colocated.row(), cost, max_staleness)
    sync_best = min(("sync", "colocated"), key=lambda name: reach[name]["seconds"])
    return {
        "model": model,
        "gpus": gpus,
        "tool_latency": {"p50_s": tool.median_s, "p99_s": tool.p99_s, "max_s": tool.max_s},
        "max_staleness": max_staleness,
        "sync_every": sync_every,
        "tried": [p.row() for p in tried],
        "recommended": best.row(),
        "sync_same_split": sync.row(),
        "sync_colocated": colocated.row(),
        "async_over_sync": best.samples_per_hour / sync.samples_per_hour,
        "async_over_colocated": best.samples_per_hour / colocated.samples_per_hour,
        "time_to_reward": {
            "assumptions": (
                f"steps to {cost.target_frac:.0%} of a lag-0 run's rise, per lag, from the staleness lab "
                f"({cost.source}: a tiny model at exact lags, correction {cost.correction!r}); a lag mix "
                "costs the share-weighted mean; time = steps x simulated step time"
            ),
            "correction": cost.correction,
            "steps_at_lag": cost.steps_at_lag,
            "lags_unreached_in_lab": sorted(cost.unreached),
            **{name: r for name, r in reach.items()},
            "sync_best_placement": sync_best,
            "speedup": reach[sync_best]["seconds"] / reach["async"]["seconds"],
            "async_over_sync": reach["sync"]["seconds"] / reach["async"]["seconds"],
            "async_over_colocated": reach["colocated"]["seconds"] / reach["async"]["seconds"],
        },
    }


def time_to_reward(row: dict[str, Any], cost: LagCost, max_staleness: int) -> dict[str, float]:
    """Learner steps to the reward for this projection's lag mix, and the wall time they take."""
    shares = lag_shares(row["lag_hist"], max_staleness)
    steps = cost.steps_for(shares)
    mean_lag = sum(lag * s for lag, s in shares.items()) / sum(shares.values())
    return {
        "steps": steps,
        "step_cost_vs_lag0": steps / cost.steps(0),
        "mean_lag": mean_lag,
        "beyond_measured_lags": max((lag for lag, s in shares.items() if s > 0), default=0.0) > cost.max_lag,
        "seconds": steps * row["step_s"],
    }


def _line(p: dict[str, Any]) -> str:
    return (
        f"  {p['engine_gpus']:>5}:{p['learner_gpus']:<5} {p['samples_per_hour']:>12,.0f} "
        f"{p['tokens_per_s_per_gpu']:>9,.0f} {p['engine_busy']:>6.2f} {p['learner_idle']:>6.2f} "
        f"{p['lag_mean']:>5.2f} {p['step_s']:>7.1f}"
    )


def render(result: dict[str, Any]) -> str:
    best, sync, colo = result["recommended"], result["sync_same_split"], result["sync_colocated"]
    tool, ttr = result["tool_latency"], result["time_to_reward"]
    lags = " ".join(f"{k.rsplit('/', 1)[1]}:{v:.2f}" for k, v in best["lag_hist"].items())
    lines = [
        f"{result['model']} on {result['gpus']} H100 · tool latency p50 {tool['p50_s']:g}s p99 {tool['p99_s']:g}s"
        + (f" max {tool['max_s']:g}s" if tool["max_s"] else "")
        + f" · max_staleness {result['max_staleness']} · sync_every {result['sync_every']}",
        "  engine:learner GPUs  samples/h  tok/s/GPU   busy   idle   lag  step s",
        *(_line(p) for p in result["tried"]),
        f"recommended split: {best['engine_gpus']} engine GPUs : {best['learner_gpus']} learner GPUs",
        f"  expected engine busy {best['engine_busy']:.2f}, learner idle {best['learner_idle']:.2f}, "
        f"mean lag {best['lag_mean']:.2f} (shares {lags})",
        f"  throughput {best['samples_per_hour']:,.0f} trained samples/h ({best['tokens_per_s_per_gpu']:,.0f} "
        f"trained tokens/s per GPU), {best['step_s']:.1f} s per step",
        f"  weight syncs pause the engines {100 * best['sync_pause_share']:.2f} % of the time",
        f"  sync at the same split: {sync['samples_per_hour']:,.0f} samples/h; colocated sync: "
        f"{colo['samples_per_hour']:,.0f} (async/colocated throughput {result['async_over_colocated']:.2f}x)",
        f"time to a reward: async {ttr['speedup']:.2f}x sooner than sync at its best placement "
        f"({ttr['sync_best_placement']}): {ttr['async']['seconds'] / 3600:.2f} h against "
        f"{ttr[ttr['sync_best_placement']]['seconds'] / 3600:.2f} h",
        f"  async needs {ttr['async']['step_cost_vs_lag0']:.2f}x the steps of lag 0 at mean lag "
        f"{ttr['async']['mean_lag']:.2f}; against sync at the same split {ttr['async_over_sync']:.2f}x, "
        f"colocated {ttr['async_over_colocated']:.2f}x; throughput alone async/sync {result['async_over_sync']:.2f}x",
        f"  assumed: {ttr['assumptions']}",
        "  (simulated with published component costs: docs/simulator.md)",
    ]
    return "\n".join(lines)


def plan_main(args: argparse.Namespace) -> int:
    result = plan(
        args.model,
        args.gpus,
        ToolLatency.parse(args.tool_latency),
        max_staleness=args.max_staleness,
        sync_every=args.sync_every,
        overlap=not args.no_overlap,
        steps=args.steps,
        batch=args.batch,
        correction=args.correction,
    )
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0
