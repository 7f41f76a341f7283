"""Async vs sync on the same workload, in one run: trained samples per hour, engine busy fraction,
learner idle ratio, the lag distribution and generated-vs-trained lengths, over several seeds.
Writes bench/results/async_vs_sync.json.

    python -m bench.async_vs_sync [--steps N | --steps-async A --steps-sync S] [--seeds K] [--latency S]
                                  [--dist lognormal|uniform] [--p99-over-median R] [--min-turns A] [--max-turns B]

Both modes use the same components (engine actor, rollout worker, buffer, learner, weight sync);
only `trainer.mode` differs. The default workload is tool-heavy and long-tailed: every assistant
turn waits for an environment whose latency is lognormal (median `--latency`, p99 = 10x median)
and trajectories take 1 to 4 environment replies, so lengths differ a lot. `--latency auto` (the
default) sets the median to the generation time of one assistant turn on this machine, measured
first in a short async calibration run (median over its finished trajectories of generate_s per
assistant turn): the environment is as slow as the model, whatever the machine's speed. Runs alternate
async/sync per seed. Throughput counts the steady state: from the first learner step to the last,
so engine start-up (identical in both) is excluded. The length histograms compare what was
generated with what was trained (the long tail must be trained, not dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from streamrl.core.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/bench_async_vs_sync.toml"


def run_mode(
    mode: str,
    root: Path,
    steps: int,
    env: dict | None,
    seed: int,
    name: str | None = None,
    config: str = CONFIG,
    extra: tuple[str, ...] = (),
) -> dict:
    """One `streamrl train` of `config` in `mode`; `env` = the latency environment's settings (None: the
    config's own tools, e.g. the code interpreter); `extra` = more config overrides (bench/simulator.py
    varies the staleness bound and the number of engines with them)."""
    name = name or f"{mode}-seed{seed}"
    overrides = [
        f"trainer.mode={mode}",
        f"trainer.total_steps={steps}",
        f"trainer.run_root={root}",
        f"trainer.run_name={name}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"learner.seed={seed}",
        *extra,
    ]
    if env is not None:
        overrides.append(f"rollout.agent.interaction_config={write_env_config(root, env, seed)}")
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "streamrl.streaming.cli", "train", "--config", config, *overrides], cwd=REPO, check=True
    )
    wall = time.time() - t0
    records = RunDir(root / name).metric_records()
    first, last = records[0], records[-1]
    span_s = last["time/elapsed_s"] - first["time/elapsed_s"]
    trained = (last["learner_step"] - first["learner_step"]) * batch_size(config)
    busy = (last["engine/busy_s"] - first["engine/busy_s"]) / max(
        last["engine/uptime_s"] - first["engine/uptime_s"], 1e-9
    )
    lags = [r.get("staleness/lag_mean") for r in records if r.get("staleness/lag_mean") is not None]
    return {
        "mode": mode,
        "seed": seed,
        "wall_s": wall,
        "steady_span_s": span_s,
        "trained_samples": trained,
        "trained_samples_per_hour": trained / span_s * 3600 if span_s > 0 else None,
        "engine_busy_fraction": busy,
        "learner_idle_ratio": last.get("learner/idle_ratio"),
        "lag_mean": sum(lags) / len(lags) if lags else None,
        "lag_max": max((r.get("staleness/lag_max") or 0) for r in records),
        "lag_hist": {k: v for k, v in last.items() if k.startswith("staleness/lag_frac/trajectories/")},
        "lengths": {k.removeprefix("length/"): v for k, v in last.items() if k.startswith("length/")},
        "sync_paused_s_mean": _mean([r["sync/paused_s"] for r in records if "sync/paused_s" in r]),
        "reward_mean_last": last.get("rollout/reward_mean"),
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _mean_sd(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


CODE_CONFIG = "configs/code_interpreter.toml"  # the second workload: SmolLM2 writing Python for the sandbox


def batch_size(config: str) -> int:
    from streamrl.streaming.config import load_config

    return load_config(REPO / config, []).buffer.batch_size


def write_env_config(root: Path, env: dict, seed: int) -> Path:
    path = root / f"latency_env_seed{seed}.yaml"
    lines = "".join(f"      {k}: {v}\n" for k, v in {**env, "seed": seed}.items())
    cls = "streamrl.workloads.interactions.latency_env.LatencyEnvironment"
    path.write_text(f"interaction:\n  - name: latency_env\n    class_name: {cls}\n    config:\n{lines}")
    return path


def turn_generate_s(run_dir: Path) -> list[float]:
    """Generation seconds per assistant turn of each finished trajectory of a run (the environment
    replies after each assistant turn but the last, so a trajectory of n turns had ceil(n/2))."""
    from streamrl.buffer.cli import load_frame

    frame = load_frame(RunDir(run_dir).buffer)
    done = frame[frame["is_latest"] & (frame["status"] == "finished")]
    return [g / ((n + 1) // 2) for g, n in zip(done["generate_s"], done["num_turns"]) if n > 0]


def calibrate(root: Path, env: dict, steps: int) -> dict:
    """One short async run at 1 s median latency: the median generation time of one assistant turn."""
    run_mode("async", root, steps, {**env, "latency_s": 1.0}, seed=1000, name="calibration")
    per_turn = sorted(turn_generate_s(root / "calibration"))
    q = statistics.quantiles(per_turn, n=10)
    return {
        "latency_s": round(statistics.median(per_turn), 3),
        "steps": steps,
        "trajectories": len(per_turn),
        "turn_generate_s": {"p10": q[0], "p50": statistics.median(per_turn), "p90": q[-1]},
        "how": "median generate_s per assistant turn of the finished trajectories of an async run at 1 s latency",
    }


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key in ("trained_samples_per_hour", "engine_busy_fraction", "learner_idle_ratio", "lag_mean", "steady_span_s"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[key] = _mean_sd(values)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run, both modes")
    parser.add_argument("--steps-async", type=int, default=110, help="learner steps of async runs (>= 2 min steady)")
    parser.add_argument("--steps-sync", type=int, default=32, help="learner steps of sync runs (>= 2 min steady)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--latency",
        default="auto",
        help="environment latency per turn: median in s, or 'auto' = one turn's generation time",
    )
    parser.add_argument("--calibration-steps", type=int, default=8, help="learner steps of the calibration run")
    parser.add_argument("--dist", choices=("lognormal", "uniform"), default="lognormal")
    parser.add_argument("--p99-over-median", type=float, default=10.0)
    parser.add_argument("--min-turns", type=int, default=1, help="fewest environment replies of a trajectory")
    parser.add_argument("--max-turns", type=int, default=4, help="most environment replies of a trajectory")
    parser.add_argument(
        "--workload",
        choices=("env", "code"),
        default="env",
        help="env: the long-tailed latency environment (tiny model); code: configs/code_interpreter.toml "
        "(SmolLM2, SFT-warmed, real sandboxed cells)",
    )
    parser.add_argument("--out", default=None, help="default bench/results/async_vs_sync[_code].json")
    args = parser.parse_args(argv)
    code = args.workload == "code"
    config = CODE_CONFIG if code else CONFIG
    out_path = Path(args.out or REPO / "bench" / "results" / f"async_vs_sync{'_code' if code else ''}.json")
    env: dict = {"distribution": args.dist, "num_turns": args.max_turns, "min_turns": args.min_turns}
    env |= {"p99_over_median": args.p99_over_median} if args.dist == "lognormal" else {}
    runs: dict[str, list[dict]] = {"async": [], "sync": []}
    # sync steps take far longer on this workload: fewer of them still give a >= 2 min steady state
    steps = {"async": args.steps or args.steps_async, "sync": args.steps or args.steps_sync}
    calibration = None
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as tmp:
        if code:
            env = None
        elif args.latency == "auto":
            calibration = calibrate(Path(tmp), env, args.calibration_steps)
            print(json.dumps({"calibration": calibration}), file=sys.stderr, flush=True)
        if env is not None:
            env["latency_s"] = calibration["latency_s"] if calibration else float(args.latency)
            if args.dist != "lognormal":
                env["jitter_s"] = env["latency_s"] / 10
        for seed in range(args.seeds):
            for mode in ("async", "sync") if seed % 2 == 0 else ("sync", "async"):
                runs[mode].append(run_mode(mode, Path(tmp), steps[mode], env, seed, config=config))
                print(json.dumps(runs[mode][-1]), file=sys.stderr, flush=True)
    ratios = [
        a["trained_samples_per_hour"] / s["trained_samples_per_hour"]
        for a, s in zip(runs["async"], runs["sync"], strict=True)
        if a["trained_samples_per_hour"] and s["trained_samples_per_hour"]
    ]
    out = {
        "command": " ".join(["python", "-m", "bench.async_vs_sync", *(argv if argv is not None else sys.argv[1:])]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "workload": {
            "config": config,
            "environment": env,
            "latency_calibration": calibration,
            "steps": steps,
            "batch_size": batch_size(config),
            "seeds": args.seeds,
        },
        "async": summarize(runs["async"]),
        "sync": summarize(runs["sync"]),
        "throughput_ratio_async_over_sync": _mean_sd(ratios) if ratios else None,
        "runs": runs,
        "targets": {"throughput_ratio": ">= 3 (mean over >= 3 seeds)", "async_engine_busy_fraction": ">= 0.95"},
    }
    out_path.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("async", "sync", "throughput_ratio_async_over_sync")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
