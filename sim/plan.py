"""`streamrl plan`: the engine:learner split a cluster should use for a model and a tool latency, with
the engine busy share, lag and throughput the simulator expects (published component costs,
`sim.published`; docs/simulator.md says what is assumed)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from streamrl.sim.costs import ToolLatency
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
    }


def _line(p: dict[str, Any]) -> str:
    return (
        f"  {p['engine_gpus']:>5}:{p['learner_gpus']:<5} {p['samples_per_hour']:>12,.0f} "
        f"{p['tokens_per_s_per_gpu']:>9,.0f} {p['engine_busy']:>6.2f} {p['learner_idle']:>6.2f} "
        f"{p['lag_mean']:>5.2f} {p['step_s']:>7.1f}"
    )


def render(result: dict[str, Any]) -> str:
    best, sync, colo = result["recommended"], result["sync_same_split"], result["sync_colocated"]
    tool = result["tool_latency"]
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
        f"  sync at the same split: {sync['samples_per_hour']:,.0f} samples/h "
        f"(async/sync {result['async_over_sync']:.2f}x); colocated sync: {colo['samples_per_hour']:,.0f} "
        f"(async/colocated {result['async_over_colocated']:.2f}x)",
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
    )
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0
