"""Where async pays: time to sync's final held-out reward, async against sync, over tool latency and
placement, each cell a learning-benchmark result (`bench/learning.py`).

    python -m bench.regime_map [--cell LATENCY PLACEMENT PATH ...] [--out bench/results/regime_map.json]

Each cell reads one `bench.learning` JSON: the speed-up of the seed means (sync's training time over
the time async's mean curve first reaches sync's final mean reward, linear between evaluations) and
its seed interval (each seed's async run against the same seed's sync run; a seed whose async run
never reaches its sync run's final reward counts as "not reached"). Cells without a result are drawn
as not measured, never filled in. The figure (`--out` with .png) is the map: one row per tool latency,
one column per placement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.learning import seed_speedups, time_to_reach

REPO = Path(__file__).resolve().parents[1]
LATENCIES = ["none", "p50 2 s, p99 20 s", "p50 2 s, p99 60 s (agentic)"]
# shared: both modes float over all cores; dedicated: both pin the engine and the learner to their own
# cores; mixed: each mode at its best placement, async dedicated against sync shared (colocated)
PLACEMENTS = ["shared", "dedicated", "mixed"]
PLACEMENT_LABELS = {"shared": "shared cores", "dedicated": "dedicated cores", "mixed": "async dedicated,\nsync shared"}
# The results that make the map, by (tool latency, placement): bench/results/ paths.
CELLS = {
    ("none", "shared"): "bench/results/learning_no_latency.json",
    ("none", "dedicated"): "bench/results/learning_no_latency_dedicated.json",
    ("none", "mixed"): "bench/results/learning_no_latency_best_placement.json",
    ("p50 2 s, p99 20 s", "shared"): "bench/results/learning_slow_tools.json",
    ("p50 2 s, p99 60 s (agentic)", "shared"): "bench/results/learning.json",
    ("p50 2 s, p99 60 s (agentic)", "dedicated"): "bench/results/learning_dedicated.json",
    ("p50 2 s, p99 60 s (agentic)", "mixed"): "bench/results/learning_best_placement.json",
}


def cell(path: Path) -> dict[str, Any]:
    """One cell from a `bench.learning` JSON: the speed-up and its per-seed interval."""
    result = json.loads(path.read_text())
    runs = [r for r in result["runs"] if r["exit_code"] == 0 and len(r["curve"]) >= 2]
    summary = result["summary"]
    if "async" not in summary or "sync" not in summary:
        raise ValueError(f"{path} holds no async-and-sync comparison")
    versus = summary.get("async_vs_sync", {})  # older results lack some of its fields
    sync_final = versus.get("sync_final_reward", summary["sync"]["after"])
    sync_s = versus.get("sync_time_s", summary["sync"]["train_s_mean"])
    reach = time_to_reach(summary["async"]["curve_wall"], sync_final)
    per_seed = seed_speedups(runs)
    reached = [v for v in per_seed.values() if v is not None]
    return {
        "source": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
        "commit": result.get("commit"),
        "num_seeds": min(summary["async"]["num_seeds"], summary["sync"]["num_seeds"]),
        "sync_final_reward": sync_final,
        "sync_time_s": sync_s,
        "async_time_to_it_s": reach,
        "speedup": sync_s / reach if reach else None,
        "speedup_per_seed": per_seed,
        "seed_interval": [min(reached), max(reached)] if reached else None,
        "seeds_not_reached": sum(v is None for v in per_seed.values()),
        "async_final_reward": summary["async"]["curve_wall"][-1][1],
        # both curves' first time to the lower final reward, sync's over async's (bench.learning.same_reward)
        "same_reward_ratio": versus.get("same_reward", {}).get("ratio"),
    }


def build(cells: dict[tuple[str, str], str]) -> dict[str, Any]:
    out: dict[str, Any] = {"latencies": LATENCIES, "placements": PLACEMENTS, "cells": []}
    for latency in LATENCIES:
        for placement in PLACEMENTS:
            source = cells.get((latency, placement))
            entry: dict[str, Any] = {"tool_latency": latency, "placement": placement}
            if source is None or not (REPO / source).exists():
                entry["measured"] = False
            else:
                entry |= {"measured": True, **cell(REPO / source)}
            out["cells"].append(entry)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lats, places = result["latencies"], result["placements"]
    fig, ax = plt.subplots(figsize=(9.5, 3.8), layout="constrained")
    for c in result["cells"]:
        x, y = places.index(c["placement"]), lats.index(c["tool_latency"])
        if not c["measured"]:
            color, text = "0.9", "not measured"
        elif c["speedup"] is None:
            color, text = "tab:red", f"async never reached\nsync's {c['sync_final_reward']:.2f}"
        else:
            color = "tab:green" if c["speedup"] >= 2 else ("khaki" if c["speedup"] >= 1 else "tab:red")
            lo_hi = c["seed_interval"]
            seeds = f"seeds {lo_hi[0]:.2f}-{lo_hi[1]:.2f}x" if lo_hi else "no seed reached"
            if c["seeds_not_reached"]:
                seeds += f", {c['seeds_not_reached']} not"
            text = f"{c['speedup']:.2f}x\n{seeds}\n({c['num_seeds']} seeds)"
            if c.get("same_reward_ratio") is not None:
                text += f"\nto the same reward: {c['same_reward_ratio']:.2f}x"
        ax.add_patch(plt.Rectangle((x - 0.48, y - 0.48), 0.96, 0.96, color=color, alpha=0.6))
        ax.text(x, y, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.5, len(places) - 0.5)
    ax.set_ylim(-0.5, len(lats) - 0.5)
    ax.set_xticks(range(len(places)), [PLACEMENT_LABELS[p] for p in places])
    ax.set_yticks(range(len(lats)), [f"tools: {lat}" for lat in lats])
    ax.set_title("async's time to sync's final held-out reward: sync time / async time", fontsize=9)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cell",
        nargs=3,
        action="append",
        metavar=("LATENCY", "PLACEMENT", "PATH"),
        help=f"a learning JSON for a cell (latency one of {LATENCIES}, placement one of {PLACEMENTS})",
    )
    parser.add_argument("--out", default=str(REPO / "bench/results/regime_map.json"))
    args = parser.parse_args(argv)
    cells = dict(CELLS)
    for latency, placement, path in args.cell or []:
        if latency not in LATENCIES or placement not in PLACEMENTS:
            parser.error(f"--cell {latency!r} {placement!r}: latency one of {LATENCIES}, placement one of {PLACEMENTS}")
        cells[(latency, placement)] = path
    result = build(cells) | {"command": "python -m bench.regime_map " + " ".join(argv or sys.argv[1:])}
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for c in result["cells"]:
        got = "not measured" if not c["measured"] else f"speedup {c['speedup']} seeds {c['speedup_per_seed']}"
        print(f"{c['tool_latency']:<30} {c['placement']:<10} {got}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
