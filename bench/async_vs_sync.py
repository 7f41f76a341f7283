"""Async vs sync on the same workload, in one run: trained samples per hour, engine busy fraction,
learner idle ratio and the lag distribution. Writes bench/results/async_vs_sync.json.

    python -m bench.async_vs_sync [--steps N] [--latency S]

Both modes use the same components (engine actor, rollout worker, buffer, learner, weight sync);
only `trainer.mode` differs. Throughput counts the steady state: from the first learner step to
the last, so engine start-up (identical in both) is excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/bench_async_vs_sync.toml"


def run_mode(mode: str, root: Path, steps: int, latency: float) -> dict:
    overrides = [
        f"trainer.mode={mode}",
        f"trainer.total_steps={steps}",
        f"trainer.run_root={root}",
        f"trainer.run_name={mode}",
    ]
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "streamrl.streaming.cli", "train", "--config", CONFIG, *overrides,
         f"rollout.agent.interaction_config={write_env_config(root, latency)}"],
        cwd=REPO, check=True,
    )
    wall = time.time() - t0
    records = [json.loads(line) for line in (root / mode / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first, last = records[0], records[-1]
    span_s = last["time/elapsed_s"] - first["time/elapsed_s"]
    trained = (last["learner_step"] - first["learner_step"]) * BATCH_SIZE
    busy = (last["engine/busy_s"] - first["engine/busy_s"]) / max(last["engine/uptime_s"] - first["engine/uptime_s"], 1e-9)
    lags = [r.get("staleness/lag_mean") for r in records if r.get("staleness/lag_mean") is not None]
    return {
        "mode": mode,
        "wall_s": wall,
        "steady_span_s": span_s,
        "trained_samples": trained,
        "trained_samples_per_hour": trained / span_s * 3600 if span_s > 0 else None,
        "engine_busy_fraction": busy,
        "learner_idle_ratio": last.get("learner/idle_ratio"),
        "lag_mean": sum(lags) / len(lags) if lags else None,
        "lag_max": max((r.get("staleness/lag_max") or 0) for r in records),
        "lag_hist": {k: v for k, v in last.items() if k.startswith("staleness/lag_frac/batch/")},
        "reward_mean_last": last.get("rollout/reward_mean"),
    }


BATCH_SIZE = 16  # buffer.batch_size of the config


def write_env_config(root: Path, latency: float) -> Path:
    path = root / "latency_env.yaml"
    path.write_text(
        "interaction:\n  - name: latency_env\n    config:\n"
        f"      latency_s: {latency}\n      jitter_s: {latency / 10}\n      num_turns: 2\n"
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--latency", type=float, default=1.0, help="environment latency per turn (s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as tmp:
        root = Path(tmp)
        results = {mode: run_mode(mode, root, args.steps, args.latency) for mode in ("async", "sync")}
    a, s = results["async"], results["sync"]
    out = {
        "command": " ".join([sys.executable.split("/")[-1], "-m", "bench.async_vs_sync", *(argv or sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "workload": {"config": CONFIG, "env_latency_s": args.latency, "steps": args.steps, "batch_size": BATCH_SIZE},
        "async": a,
        "sync": s,
        "throughput_ratio_async_over_sync": (
            a["trained_samples_per_hour"] / s["trained_samples_per_hour"]
            if a["trained_samples_per_hour"] and s["trained_samples_per_hour"] else None
        ),
        "targets": {"throughput_ratio": ">= 3", "async_engine_busy_fraction": ">= 0.95"},
    }
    path = REPO / "bench" / "results" / "async_vs_sync.json"
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
