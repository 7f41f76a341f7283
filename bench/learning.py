"""`make learn-bench`: does streamrl train a real model, and how much sooner does async get there?

SmolLM2-135M on the calculator task (`configs/learning_smollm2.toml`: the warm-up teaches both ways to
answer, the tool or at once, and RL learns that on 4-digit problems only the tool pays; every tool
call has the latency of a real coding agent's tools: median 2 s, p99 60 s) is trained by `streamrl train`
in async and in sync mode, for several seeds. Each run keeps a checkpoint every `--eval-every` steps;
after it, `streamrl eval` scores its base model and every checkpoint on the same held-out prompts on one
engine (`RUN_DIR/eval_offline/`), and each score is placed at the training time its step ended. So the
evaluation takes no engine time from training and holds no weight sync, in either mode
(`--eval-during-training` evaluates inside the runs instead, version-pinned, as `[eval]` does).

Reported (bench/results/learning.json, learning.png):
- per mode: the held-out reward before training and at the end, pooled over seeds as (seed, prompt)
  pairs, with the paired test (exact McNemar on 0/1 rewards, else a sign-flip permutation test) and a
  bootstrap interval. Target: a rise of >= 0.10, significant at 95 %.
- time to sync's final reward: the wall time at which async's seed-mean curve first reaches the
  seed-mean final held-out reward of sync, against sync's whole wall time. Target: <= 1/2.
- the curves: held-out reward against wall-clock and against learner step, mean and range over seeds.

The sync baseline is verl's DAPO recipe, not one group at a time: each generation round admits
`trainer.sync_generation_groups` groups at once (32 trajectories, the engine's concurrency), waits for
the whole round, and trains on groups with a signal; leftovers are evicted as stale (max_staleness 0),
so every trained token is on-policy. Rounds repeat while the filter leaves no full batch.

    python -m bench.learning [--seeds 0 1 2] [--modes async sync] [--steps 8] [--eval-every 2]
                             [--config configs/learning_smollm2.toml] [--sync-overrides ...] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from streamrl.core.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/learning_smollm2.toml"
SYNC_OVERRIDES = ["trainer.sync_generation_groups=8", "buffer.max_staleness=0", "buffer.over_age=evict"]
# Async runs the config's own staleness bound (max_staleness 2): the real-system sweep
# (bench/results/staleness_real.json, docs/staleness.md) measured it level with sync per learner step,
# where 7 (the same 32 trajectories in flight as sync's round) learned less per step.
ASYNC_OVERRIDES: list[str] = []


def train(
    config: str,
    mode: str,
    seed: int,
    root: Path,
    steps: int,
    eval_every: int,
    overrides: list[str],
    log: Path,
    *,
    offline_eval: bool = True,
) -> tuple[Path, float, int]:
    """One `streamrl train`; (run dir, wall seconds, exit code). With `offline_eval` the run evaluates
    nothing itself and keeps a checkpoint every `eval_every` steps; `evaluate_offline` scores them."""
    name = f"{mode}-s{seed}"
    schedule = (
        ["eval.num_prompts=0", f"trainer.checkpoint_every={eval_every}", "trainer.keep_checkpoints=0"]
        if offline_eval
        else [f"eval.every_steps={eval_every}", f"trainer.checkpoint_every={steps}"]
    )
    args = [
        f"trainer.mode={mode}",
        f"trainer.seed={seed}",
        f"trainer.total_steps={steps}",
        f"trainer.run_root={root}",
        f"trainer.run_name={name}",
        *schedule,
        "wandb.enabled=false",
        *overrides,
    ]
    t0 = time.monotonic()
    rc = _cli(["train", "--config", config, *args], log)
    return root / name, time.monotonic() - t0, rc


def evaluate_offline(run_dir: Path, num_prompts: int, log: Path) -> int:
    """`streamrl eval` of the run's base model and every checkpoint on one engine, after the run: the
    evaluation takes no engine time from training, in either mode (RUN_DIR/eval_offline/). The
    checkpoints' optimizer states (1 GB each for SmolLM2) go afterwards: the weights stay for a look,
    but a checkpoint without its state is no longer whole, so streamrl eval skips it from then on."""
    args = ["eval", str(run_dir), "--checkpoint", "base", "--checkpoint", "all", f"eval.num_prompts={num_prompts}"]
    args.append(f"rollout.max_concurrent_per_worker={num_prompts}")  # every prompt at once: tools wait in parallel
    rc = _cli(args, log)
    for state in RunDir(run_dir).checkpoints.glob("*/optimizer.pt"):
        state.unlink()
    return rc


def _cli(args: list[str], log: Path) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    with open(log, "ab") as out:
        return subprocess.run(
            [sys.executable, "-m", "streamrl.streaming.cli", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode


def eval_prompts(config: str) -> int:
    from streamrl.streaming.config import load_config

    return load_config(str(REPO / config), []).eval.num_prompts


def finished_wall_s(run_dir: Path) -> float:
    """A finished run's wall time from its own record: the run's elapsed time at its last metrics line."""
    rows = RunDir(run_dir).metric_records()
    return float(rows[-1]["elapsed_s"]) if rows else 0.0


def curve(run_dir: Path) -> list[dict[str, Any]]:
    """Every evaluation of a run: served step, version, training wall time, avg reward, per-prompt scores.
    A run evaluated offline (`evaluate_offline`) is read from its checkpoints' evaluations, each placed at
    the training time its learner step ended (the base model at 0)."""
    import pyarrow.parquet as pq

    from streamrl.streaming.heldout import evaluated_steps, read_evaluation

    run = RunDir(run_dir)
    offline = sorted(run.eval_offline.glob("*.parquet")) if run.eval_offline.exists() else []
    if offline and not evaluated_steps(run_dir):
        ended = {
            int(r["learner_step"]): float(r["elapsed_s"])
            for r in run.metric_records()
            if any(k.startswith("learner/") for k in r)
        }
        points = []
        for path in offline:
            meta = pq.read_table(path, columns=["served_step", "eval_seconds"]).to_pylist()[0]
            scores = read_evaluation(path)
            step = int(meta["served_step"])
            points.append(
                {
                    "served_step": step,
                    "policy_version": step,
                    "elapsed_s": ended[step] if step else 0.0,
                    "eval_seconds": meta["eval_seconds"],
                    "reward": statistics.fmean(scores.values()),
                    "scores": scores,
                }
            )
        return sorted(points, key=lambda p: p["served_step"])
    points = []
    for step, path in sorted(evaluated_steps(run_dir).items()):
        meta = pq.read_table(path, columns=["policy_version", "run_elapsed_s", "eval_seconds"]).to_pylist()[0]
        scores = read_evaluation(path)
        points.append(
            {
                "served_step": step,
                "policy_version": meta["policy_version"],
                "elapsed_s": meta["run_elapsed_s"],
                "eval_seconds": meta["eval_seconds"],
                "reward": statistics.fmean(scores.values()),
                "scores": scores,
            }
        )
    return points


def pooled(runs: list[dict[str, Any]], which: int) -> dict[str, float]:
    """(seed, prompt) -> score of evaluation `which` (0 = first, -1 = last) of every run."""
    return {f"{r['seed']}/{p}": s for r in runs for p, s in r["curve"][which]["scores"].items()}


def mean_curve(runs: list[dict[str, Any]], x: str) -> list[tuple[float, float, float, float]]:
    """(mean x, mean reward, min reward, max reward) per evaluation index over the seeds."""
    n = min(len(r["curve"]) for r in runs)
    out = []
    for i in range(n):
        pts = [r["curve"][i] for r in runs]
        rewards = [p["reward"] for p in pts]
        out.append((statistics.fmean(p[x] for p in pts), statistics.fmean(rewards), min(rewards), max(rewards)))
    return out


def time_to_reach(points: list[tuple[float, float, float, float]], target: float) -> float | None:
    """First wall time at which the mean curve reaches `target` (linear between evaluations)."""
    for (t0, r0, *_), (t1, r1, *_) in zip(points, points[1:]):
        if r1 >= target:
            return t0 if r0 >= target else t0 + (t1 - t0) * (target - r0) / (r1 - r0)
    return points[0][0] if points and points[0][1] >= target else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    from streamrl.streaming.eval_stats import compare

    out: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in runs}):
        done = [r for r in runs if r["mode"] == mode and r["exit_code"] == 0 and len(r["curve"]) >= 2]
        if not done:
            continue
        scored = [r for r in done if "scores" in r["curve"][0]]  # runs merged from an older JSON may lack them
        result = compare(pooled(scored, 0), pooled(scored, -1))
        out[mode] = {
            "num_seeds": len(done),
            "tested_seeds": [r["seed"] for r in scored],  # the runs whose per-prompt scores the test pools
            **result.record(),
            "wall_s_mean": statistics.fmean(r["wall_s"] for r in done),
            "train_s_mean": statistics.fmean(r["curve"][-1]["elapsed_s"] for r in done),
            "curve_wall": mean_curve(done, "elapsed_s"),
            "curve_step": mean_curve(done, "served_step"),
            "rise_target_met": result.diff >= 0.10 and result.p_value < 0.05,
            "gradient_share": [r["gradient_share"] for r in done],
            "time_split": [r.get("time_split") for r in done],  # runs merged from an older JSON lack it
        }
    if "async" in out and "sync" in out:
        target = out["sync"]["curve_wall"][-1][1]  # sync's final reward, the mean over every seed it ran
        reach = time_to_reach(out["async"]["curve_wall"], target)
        sync_s = out["sync"]["train_s_mean"]
        per_seed = seed_speedups(runs)
        out["async_vs_sync"] = {
            "sync_final_reward": target,
            "async_time_to_it_s": reach,
            "sync_time_s": sync_s,
            "ratio": reach / sync_s if reach is not None else None,
            "speedup": sync_s / reach if reach else None,  # sync's time / async's time to sync's final reward
            "speedup_per_seed": per_seed,  # each seed's async against the same seed's sync (None: never reached)
            "target_met": reach is not None and reach <= 0.5 * sync_s,
            "same_reward": same_reward(out["sync"]["curve_wall"], out["async"]["curve_wall"]),
            "same_reward_per_seed": seed_same_rewards(runs),
        }
    return out


def same_reward(sync: list[tuple], fast: list[tuple]) -> dict[str, float | None]:
    """Both curves' first time to the lower of their final rewards (each on its way up, linear
    between evaluations) and their ratio, sync's time over async's: the time to the same reward,
    where `speedup` sets sync's whole run against async's first arrival at sync's final reward."""
    target = min(sync[-1][1], fast[-1][1])
    sync_s, async_s = time_to_reach(sync, target), time_to_reach(fast, target)
    return {
        "reward": target,
        "sync_time_s": sync_s,
        "async_time_s": async_s,
        "ratio": sync_s / async_s if sync_s and async_s else None,
    }


def seed_same_rewards(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """`same_reward` per seed run in both modes, on each run's own points."""
    by = {(r["mode"], r["seed"]): r for r in runs if r["exit_code"] == 0 and len(r["curve"]) >= 2}
    points = lambda run: [(p["elapsed_s"], p["reward"]) for p in run["curve"]]  # noqa: E731
    return {
        str(seed): same_reward(points(by[("sync", seed)]), points(by[("async", seed)]))
        for seed in sorted({seed for mode, seed in by if mode == "sync" and ("async", seed) in by})
    }


def seed_speedups(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per seed run in both modes: the sync run's training time over the time the async run first
    reaches the sync run's final held-out reward (its own points, linear between evaluations)."""
    by = {(r["mode"], r["seed"]): r for r in runs if r["exit_code"] == 0 and len(r["curve"]) >= 2}
    out: dict[str, float | None] = {}
    for seed in sorted({seed for mode, seed in by if mode == "sync" and ("async", seed) in by}):
        sync, fast = by[("sync", seed)]["curve"], by[("async", seed)]["curve"]
        reach = time_to_reach([(p["elapsed_s"], p["reward"]) for p in fast], sync[-1]["reward"])
        out[str(seed)] = sync[-1]["elapsed_s"] / reach if reach else None
    return out


def merged_runs(path: Path, have: set[tuple[str, int]]) -> list[dict[str, Any]]:
    """The runs of an earlier result JSON that are not in `have`, each marked with the commit and
    command it came from."""
    earlier = json.loads(path.read_text())
    return [
        r | {"merged_from": {"commit": earlier["commit"], "command": earlier["command"]}}
        for r in earlier["runs"]
        if (r["mode"], r["seed"]) not in have
    ]


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics lines (none when it never wrote any)."""
    run = RunDir(run_dir)
    return run.metric_records() if run.metrics.exists() else []


def gradient_share(run_dir: Path) -> dict[str, float] | None:
    """The run's last buffer counters: trajectories generated (finished members of settled groups),
    trained (members of groups the learner used) and their share."""
    for row in reversed(metric_rows(run_dir)):
        if "buffer/trajectories_generated" in row:
            keys = ("buffer/trajectories_generated", "buffer/trajectories_trained", "buffer/gradient_share")
            return {k.split("/", 1)[1]: float(row[k]) for k in keys}
    return None


def time_split(run_dir: Path) -> dict[str, float] | None:
    """Where a run's training time went, from its metrics: the learner's mean step seconds, the share
    of the run the driver waited for a batch, the engines' busy share, and the groups the DAPO filter
    dropped against those trained (one group per step at the benchmark's batch)."""
    rows = [r for r in metric_rows(run_dir) if "learner/step_s" in r]
    if not rows:
        return None
    last = rows[-1]
    return {
        "learner_step_s_mean": statistics.fmean(float(r["learner/step_s"]) for r in rows),
        "learner_idle_ratio": float(last.get("learner/idle_ratio", float("nan"))),
        "engine_busy_fraction": float(last.get("engine/busy_fraction", float("nan"))),
        "groups_filtered": float(last.get("buffer/groups_filtered", float("nan"))),
        "groups_trained": float(last.get("buffer/batches_sampled", len(rows))),
    }


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    for mode, color in (("async", "tab:blue"), ("sync", "tab:orange")):
        if mode not in summary:
            continue
        for ax, key, xlabel in (
            (axes[0], "curve_wall", "training wall time (s)"),
            (axes[1], "curve_step", "learner step of the evaluated weights"),
        ):
            xs, mean, low, high = zip(*summary[mode][key])
            ax.plot(xs, mean, marker="o", color=color, label=f"{mode} (mean of {summary[mode]['num_seeds']} seeds)")
            ax.fill_between(xs, low, high, color=color, alpha=0.2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out reward (version-pinned)")
            ax.legend()
    if "async_vs_sync" in summary and summary["async_vs_sync"]["async_time_to_it_s"] is not None:
        axes[0].axhline(summary["async_vs_sync"]["sync_final_reward"], color="gray", linestyle=":", linewidth=1)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument(
        "--sync-overrides",
        nargs="*",
        default=SYNC_OVERRIDES,
        help="config overrides for the sync runs only (default: verl-style generation rounds)",
    )
    parser.add_argument(
        "--async-overrides",
        nargs="*",
        default=ASYNC_OVERRIDES,
        help="config overrides for the async runs only (default: none, the config's max_staleness 2)",
    )
    parser.add_argument(
        "--reuse-finished",
        action="store_true",
        help="with --keep: a <mode>-s<seed> run already finished there is read, not trained again",
    )
    parser.add_argument("--out", default=str(REPO / "bench/results/learning.json"))
    parser.add_argument("--plot", default=None, help="default: the --out path with .png")
    parser.add_argument("--keep", default=None, help="keep the run directories in this folder")
    parser.add_argument(
        "--eval-during-training",
        dest="offline_eval",
        action="store_false",
        help="evaluate during the runs (eval.every_steps) instead of scoring their checkpoints (one every "
        "--eval-every steps) after each run; during a run the evaluation shares the engines and holds the "
        "next weight sync, which costs async more than sync",
    )
    parser.add_argument(
        "--from-runs",
        default=None,
        metavar="DIR",
        help="train nothing: summarize the <mode>-s<seed> run directories already in DIR",
    )
    parser.add_argument(
        "--merge",
        default=None,
        metavar="JSON",
        help="add the runs of an earlier result JSON whose (mode, seed) this command does not run",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    return parser.parse_args(argv)


def run_record(mode: str, seed: int, exit_code: int, wall_s: float, run_dir: Path) -> dict[str, Any]:
    """One run's entry of the result: its held-out curve and what its metrics say (none if it never started)."""
    ran = run_dir.exists()
    return {
        "mode": mode,
        "seed": seed,
        "exit_code": exit_code,
        "wall_s": wall_s,
        "curve": curve(run_dir) if ran else [],
        "gradient_share": gradient_share(run_dir) if ran else None,
        "time_split": time_split(run_dir) if ran else None,
    }


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine

    args = parse_args(argv)
    root = Path(args.keep or args.from_runs or tempfile.mkdtemp(prefix="streamrl-learning-"))
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    t_start = time.monotonic()
    for seed in args.seeds:
        for mode in args.modes:  # interleaved, so a slow spell of the machine touches both modes alike
            done_dir = Path(args.from_runs or args.keep or root) / f"{mode}-s{seed}"
            finished = RunDir(done_dir).accounting.exists()
            if args.from_runs or (args.reuse_finished and finished):
                if not finished:
                    continue  # not finished (or never run): left out
                run_dir, wall, rc = done_dir, finished_wall_s(done_dir), 0
            else:
                overrides = args.overrides + (args.sync_overrides if mode == "sync" else args.async_overrides)
                run_dir, wall, rc = train(
                    args.config,
                    mode,
                    seed,
                    root,
                    args.steps,
                    args.eval_every,
                    overrides,
                    root / "train.log",
                    offline_eval=args.offline_eval,
                )
                if rc == 0 and args.offline_eval:
                    rc = evaluate_offline(run_dir, eval_prompts(args.config), root / "train.log")
            runs.append(run_record(mode, seed, rc, wall, run_dir))
            points = runs[-1]["curve"]
            line = " ".join(f"{p['served_step']}:{p['reward']:.3f}" for p in points)
            print(f"{mode} seed {seed}: rc={rc} {wall:.0f}s held-out by step {line}", flush=True)
    if args.merge:
        runs += merged_runs(Path(args.merge), {(r["mode"], r["seed"]) for r in runs})
    summary = summarize(runs)
    result = {
        "command": "python -m bench.learning " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": args.config,
        "overrides": args.overrides,
        "sync_overrides": args.sync_overrides,
        "async_overrides": args.async_overrides,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "seeds": args.seeds,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "total_wall_s": time.monotonic() - t_start,
        "summary": summary,
        "runs": runs,  # each curve point with its per-prompt scores, so a later run can merge these
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(
        summary,
        Path(args.plot or out.with_suffix(".png")),
        f"{Path(args.config).stem}: held-out reward, {len({r['seed'] for r in runs})} seed(s) ({machine()['cpu']}, "
        f"{machine()['cpu_count']} cores)",
    )
    for mode in ("async", "sync"):
        if mode in summary:
            s = summary[mode]
            print(
                f"{mode}: {s['before']:.3f} -> {s['after']:.3f} (rise {s['rise']:+.3f}, 95% CI "
                f"[{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}], {s['test']} p={s['p_value']:.2g}) "
                f"in {s['train_s_mean']:.0f} s of training"
            )
    if "async_vs_sync" in summary:
        print("async reaches sync's final held-out reward after:", summary["async_vs_sync"])
    print(f"wrote {out}")
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
