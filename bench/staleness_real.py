"""Does staleness cost learning per step on the real system? The staleness sweep, end to end.

The learning benchmark's async runs (`configs/learning_smollm2.toml`: SmolLM2-135M, the calculator
behind agent-like tool latency, engines, buffer, weight sync with partial rollouts) are trained again
with `buffer.max_staleness` in {0, 1, 2, 4} and the default correction (AReaL's decoupled PPO), and
with the correction off (`learner.correction.mode=none`: the PPO ratio against the behaviour policy),
and with `buffer.admission = "expected"` (eN), which counts in-flight groups by the share the DAPO
filter keeps, so a small bound no longer shrinks the window of groups in flight.
Each run's checkpoints are scored after it on the same 128 held-out prompts as the learning
benchmark (`bench.learning.evaluate_offline`), so every point is a version-pinned held-out reward at
a learner step, comparable with the learning benchmark's. Its `max_staleness = 7` result
(`bench/results/learning_s7.json`) supplies two more settings: async at `max_staleness = 7` and the
sync baseline (every token on-policy).

`max_staleness` is the knob AReaL defines: it bounds both the trained tokens' lag and, through the
admission rule `(max_staleness + version + 1) x batch`, how many groups are in flight. Over-age
groups are trained (`buffer.over_age = "train"`, the default), so the measured lag (`lag` below, from
the runs' own `is/token_frac` metrics) is reported beside the bound.

Reported (bench/results/staleness_real.json + png): per setting, the held-out reward at each
evaluated step (mean, min, max over seeds), the rise with its paired test, the share of trained
tokens at each lag, the training time, and whether the mean sits within sync's seed spread (or
above it) at every evaluated step.

    python -m bench.staleness_real [--settings s0 s1 s2 s4 none7] [--seeds 1 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.learning import (
    CONFIG,
    REPO,
    curve,
    eval_prompts,
    evaluate_offline,
    finished_wall_s,
    gradient_share,
    mean_curve,
    same_reward,
    time_to_reach,
    train,
)
from bench.machine import machine
from streamrl.core.run_dir import RunDir

# name -> the async run's overrides (the rest is the learning benchmark's config)
SETTINGS: dict[str, list[str]] = {
    "s0": ["buffer.max_staleness=0"],
    "s1": ["buffer.max_staleness=1"],
    "s2": ["buffer.max_staleness=2"],
    "s4": ["buffer.max_staleness=4"],
    "s7": ["buffer.max_staleness=7"],
    "none2": ["buffer.max_staleness=2", "learner.correction.mode=none"],
    # admission = "expected": in-flight groups counted by the share the DAPO filter keeps (buffer.admission)
    "e1": ["buffer.max_staleness=1", "buffer.admission=expected"],
    "e2": ["buffer.max_staleness=2", "buffer.admission=expected"],
    "none7": ["buffer.max_staleness=7", "learner.correction.mode=none"],
}
REFERENCE = REPO / "bench/results/learning_s7.json"
LAG_KEY = "is/token_frac/"


def token_lag_shares(run_dir: Path) -> dict[str, float]:
    """The run's trained action tokens by lag bucket, averaged over its learner steps."""
    rows = [r for r in RunDir(run_dir).metric_records() if any(k.startswith(LAG_KEY) for k in r)]
    buckets = sorted({k for r in rows for k in r if k.startswith(LAG_KEY)})
    return {k.removeprefix(LAG_KEY): statistics.fmean(float(r.get(k, 0.0)) for r in rows) for k in buckets}


def finished(run_dir: Path) -> bool:
    """Trained and scored earlier in this folder: read, not trained again."""
    return RunDir(run_dir).accounting.exists() and any(RunDir(run_dir).eval_offline.glob("*.parquet"))


def run_one(name: str, seed: int, root: Path, steps: int, eval_every: int, log: Path) -> dict[str, Any]:
    run_dir = root / name / f"async-s{seed}"
    if finished(run_dir):
        rc, wall = 0, finished_wall_s(run_dir)
    else:
        (root / name).mkdir(parents=True, exist_ok=True)
        run_dir, wall, rc = train(CONFIG, "async", seed, root / name, steps, eval_every, SETTINGS[name], log)
        if rc == 0:
            rc = evaluate_offline(run_dir, eval_prompts(CONFIG), log)
    points = curve(run_dir) if rc == 0 else []
    return {
        "setting": name,
        "overrides": SETTINGS[name],
        "seed": seed,
        "exit_code": rc,
        "wall_s": wall,
        "curve": points,
        "lag": token_lag_shares(run_dir) if rc == 0 else {},
        "gradient_share": gradient_share(run_dir) if rc == 0 else None,
    }


def reference_runs(path: Path) -> list[dict[str, Any]]:
    """The learning benchmark's runs as two more settings: async at max_staleness 7 and sync."""
    data = json.loads(path.read_text())
    return [
        {
            "setting": "s7" if r["mode"] == "async" else "sync",
            "overrides": data["async_overrides"] if r["mode"] == "async" else data["sync_overrides"],
            "seed": r["seed"],
            "exit_code": r["exit_code"],
            "wall_s": r["wall_s"],
            "curve": r["curve"],
            "from": str(path.relative_to(REPO)),
        }
        for r in data["runs"]
    ]


def earlier_runs(path: Path, replaced: set[tuple[str, int]]) -> list[dict[str, Any]]:
    """The trained runs of an earlier result at `path` (its reference runs are read again from their
    own file), less the (setting, seed) pairs in `replaced`."""
    if not path.exists():
        return []
    return [
        r for r in json.loads(path.read_text())["runs"] if "from" not in r and (r["setting"], r["seed"]) not in replaced
    ]


def by_step(runs: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Evaluated step -> the rewards of every seed evaluated there."""
    out: dict[int, list[float]] = {}
    for r in runs:
        for p in r["curve"]:
            out.setdefault(int(p["served_step"]), []).append(float(p["reward"]))
    return dict(sorted(out.items()))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    from streamrl.streaming.eval_stats import compare

    done = [r for r in runs if r["exit_code"] == 0 and len(r["curve"]) >= 2]
    sync = by_step([r for r in done if r["setting"] == "sync"])
    sync_runs = [r for r in done if r["setting"] == "sync"]
    sync_wall = mean_curve(sync_runs, "elapsed_s") if sync_runs else None
    out: dict[str, Any] = {}
    for name in sorted({r["setting"] for r in done}):
        mine = [r for r in done if r["setting"] == name]
        steps = by_step(mine)
        scored = [r for r in mine if "scores" in r["curve"][-1]]
        first = {f"{r['seed']}/{p}": s for r in scored for p, s in r["curve"][0]["scores"].items()}
        last = {f"{r['seed']}/{p}": s for r in scored for p, s in r["curve"][-1]["scores"].items()}
        test = compare(first, last) if scored else None
        within = {
            str(step): statistics.fmean(rs) >= min(sync[step])
            for step, rs in steps.items()
            if step > 0 and step in sync
        }
        lags = [r["lag"] for r in mine if r.get("lag")]
        out[name] = {
            "seeds": sorted(r["seed"] for r in mine),
            "per_step": {
                str(s): {"mean": statistics.fmean(rs), "min": min(rs), "max": max(rs)} for s, rs in steps.items()
            },
            "rise": test.diff if test else None,
            "ci95": [test.ci_low, test.ci_high] if test else None,
            "p_value": test.p_value if test else None,
            "tested_seeds": sorted(r["seed"] for r in scored),
            "train_s_mean": statistics.fmean(r["curve"][-1]["elapsed_s"] for r in mine),
            "token_lag_share": {
                k: statistics.fmean(s.get(k, 0.0) for s in lags) for k in sorted({k for s in lags for k in s})
            }
            if lags
            else None,
            "within_sync_spread": within,  # mean at or above sync's lowest seed at every evaluated step
            "time_to_reward": time_against_sync(mean_curve(mine, "elapsed_s"), sync_wall)
            if sync_wall and name != "sync"
            else None,
            "per_step_target_met": bool(within) and all(within.values()),
        }
    return out


def time_against_sync(wall: list[tuple], sync_wall: list[tuple]) -> dict[str, Any]:
    """The learning benchmark's two readings against sync's seed-mean curve: `speedup` (sync's training
    time over this setting's first time at sync's final reward) and `same_reward` (both curves' first
    time to the lower final reward). Training time only; the sync runs are the learning benchmark's,
    made on another day, so the machine's load may differ (`machine` of each JSON)."""
    target, sync_s = sync_wall[-1][1], sync_wall[-1][0]
    reach = time_to_reach(wall, target)
    return {
        "sync_final_reward": target,
        "time_to_it_s": reach,
        "sync_time_s": sync_s,
        "speedup": sync_s / reach if reach else None,
        "same_reward": same_reward(sync_wall, wall),
    }


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(["sync", "s0", "s1", "s2", "s4", "s7", "e1", "e2"], "decoupled correction, by max_staleness")]
    if any(name.startswith("none") for name in summary):  # the second panel only where it has runs
        panels.append((["sync", "s2", "none2", "s7", "none7"], "correction on (sN) against off (noneN)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True, layout="constrained")
    for ax, (names, label) in zip(np.atleast_1d(axes), panels):
        for name in names:
            if name not in summary:
                continue
            rows = summary[name]["per_step"]
            xs = [int(s) for s in rows]
            style = {"color": "black", "linewidth": 2} if name == "sync" else {}
            ax.plot(xs, [rows[s]["mean"] for s in rows], marker="o", label=name, **style)
            if name == "sync":
                ax.fill_between(
                    xs, [rows[s]["min"] for s in rows], [rows[s]["max"] for s in rows], color="gray", alpha=0.2
                )
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("learner step of the evaluated weights")
        ax.set_ylabel("held-out reward (version-pinned)")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["s0", "s2", "s4", "s1", "none7"], choices=sorted(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--keep", default=None, help="keep the run directories here; finished runs are read again")
    parser.add_argument("--reference", default=str(REFERENCE), help="learning.json whose s7 and sync runs join")
    parser.add_argument("--only-finished", action="store_true", help="train nothing: summarize the finished runs")
    parser.add_argument("--out", default=str(REPO / "bench/results/staleness_real.json"))
    parser.add_argument(
        "--merge", action="store_true", help="keep --out's earlier runs of the settings and seeds not trained now"
    )
    args = parser.parse_args(argv)
    root = Path(args.keep or tempfile.mkdtemp(prefix="streamrl-staleness-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs = []
    for seed in args.seeds:
        for name in args.settings:  # seeds outermost: a cut-short sweep still covers every setting once
            if args.only_finished and not finished(root / name / f"async-s{seed}"):
                continue
            run = run_one(name, seed, root, args.steps, args.eval_every, root / "train.log")
            runs.append(run)
            line = " ".join(f"{p['served_step']}:{p['reward']:.3f}" for p in run["curve"])
            print(f"{name} seed {seed}: rc={run['exit_code']} {run['wall_s']:.0f}s held-out by step {line}", flush=True)
    earlier = earlier_runs(Path(args.out), {(r["setting"], r["seed"]) for r in runs}) if args.merge else []
    runs = [*earlier, *runs, *reference_runs(Path(args.reference))]
    summary = summarize(runs)
    settings = list(dict.fromkeys([*(r["setting"] for r in earlier), *args.settings]))
    result = {
        "command": "python -m bench.staleness_real " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": CONFIG,
        "settings": {name: SETTINGS[name] for name in settings},
        "steps": args.steps,
        "eval_every": args.eval_every,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "total_wall_s": time.monotonic() - t0,
        "summary": summary,
        "runs": runs,
    }
    if args.merge and Path(args.out).exists():  # how and where the kept runs were made
        result["note"] = json.loads(Path(args.out).read_text()).get("note", "")
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(summary, out.with_suffix(".png"), f"held-out reward by step, async by max_staleness ({machine()['cpu']})")
    for name, s in summary.items():
        steps = " ".join(f"{k}:{v['mean']:.3f}" for k, v in s["per_step"].items())
        print(f"{name}: {steps} within sync's spread: {s['per_step_target_met']}")
    print(f"wrote {out}")
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
