"""The projections of bench/simulator.py: 7B and 32B dense and a 235B MoE on 64-1,024 H100 with a
long-tailed tool latency (p50 2 s, p99 60 s, 120 s timeout), from published component costs
(streamrl/sim/published.py cites each)."""

from __future__ import annotations

from typing import Any

from streamrl.sim.costs import ToolLatency, TrajectoryShape
from streamrl.sim.project import SHARES, best_split, project
from streamrl.sim.published import MODELS

TOOL = ToolLatency(2.0, 60.0, 120.0)
GPUS = (64, 256, 1024)
STALENESS = (0, 1, 2, 4, 8)
SYNC_EVERY = (1, 2, 4)


def _rows(ps: list[Any]) -> list[dict[str, Any]]:
    return [p.row() for p in ps]


def split_curves() -> dict[str, Any]:
    """Throughput against the engine share, async and sync, each model at 256 GPUs."""
    out = {}
    for name, model in MODELS.items():
        out[name] = {
            mode: _rows([project(model, gpus=256, engine_share=s, tool=TOOL, mode=mode) for s in SHARES])
            for mode in ("async", "sync")
        }
    return out


def knob_curves(model_name: str = "7B", gpus: int = 256) -> dict[str, Any]:
    """Throughput against max_staleness and sync_every at the best async split of one model."""
    model = MODELS[model_name]
    best, _ = best_split(model, gpus=gpus, tool=TOOL, mode="async")
    share = best.engine_gpus / gpus
    kw = dict(gpus=gpus, engine_share=share, tool=TOOL)
    return {
        "model": model_name,
        "gpus": gpus,
        "engine_share": share,
        "max_staleness": _rows([project(model, max_staleness=s, **kw) for s in STALENESS]),
        "sync_every": _rows([project(model, sync_every=e, **kw) for e in SYNC_EVERY]),
    }


def ratios() -> dict[str, Any]:
    """Async (best split) over sync (best split) and over colocated sync, by model and GPU count."""
    out: dict[str, Any] = {}
    for name, model in MODELS.items():
        for gpus in GPUS:
            a, _ = best_split(model, gpus=gpus, tool=TOOL, mode="async")
            s = max(
                (project(model, gpus=gpus, engine_share=x, tool=TOOL, mode="sync") for x in (0.25, 0.5, 0.75)),
                key=lambda p: p.samples_per_hour,
            )
            c = project(model, gpus=gpus, engine_share=1.0, tool=TOOL, mode="colocated")
            out[f"{name}@{gpus}"] = {
                "async": a.row(),
                "sync": s.row(),
                "colocated": c.row(),
                "async_over_sync": a.samples_per_hour / s.samples_per_hour,
                "async_over_colocated": a.samples_per_hour / c.samples_per_hour,
            }
    return out


def pause_shares() -> dict[str, Any]:
    """The engines' sync pause share, staged (overlap) against in-place weight loading, at 256 GPUs."""
    out = {}
    for name, model in MODELS.items():
        best, _ = best_split(model, gpus=256, tool=TOOL, mode="async")
        share = best.engine_gpus / 256
        out[name] = {
            str(overlap): project(model, gpus=256, engine_share=share, tool=TOOL, overlap=overlap).row()
            for overlap in (True, False)
        }
    return out


def math_shape() -> TrajectoryShape:
    """AReaL / verl-async's workload: one long reasoning answer, no tools; lengths 0.5k-28k tokens,
    median ~4k (DAPO-style math with a 28k cap; an approximation of their length histograms)."""
    q = [500 * (56 ** ((i / 20) ** 1.2)) for i in range(21)]
    return TrajectoryShape(turn_probs=(1.0,), turn_tokens=tuple(q), prompt_tokens=512.0)


def areal_check() -> dict[str, Any]:
    """The published 2.35-2.77x at 128 GPUs (verl-async Qwen2.5-7B; AReaL): async at its best split
    against colocated sync on the same 128 GPUs, math workload, no tool latency."""
    model, shape, none = MODELS["7B"], math_shape(), ToolLatency(0.0, 0.0)
    a, _ = best_split(model, gpus=128, tool=none, mode="async", shape=shape)
    c = project(model, gpus=128, engine_share=1.0, tool=none, mode="colocated", shape=shape)
    return {
        "published": {"verl_fully_async_7B_128gpus": [2.35, 2.67], "AReaL_max": 2.77},
        "async": a.row(),
        "colocated": c.row(),
        "async_over_colocated": a.samples_per_hour / c.samples_per_hour,
    }


def projections() -> dict[str, Any]:
    return {
        "tool_latency": {"p50_s": TOOL.median_s, "p99_s": TOOL.p99_s, "max_s": TOOL.max_s},
        "split": split_curves(),
        "knobs": knob_curves(),
        "ratios": ratios(),
        "pause": pause_shares(),
        "areal_check": areal_check(),
    }
