"""The pipeline simulator (streamrl.sim, docs/simulator.md): validated against real runs of
bench/async_vs_sync.py's latency workload on this machine, then projected to large clusters with
published component costs. Writes bench/results/simulator.json and bench/results/simulator.png.

    python -m bench.simulator validate --runs DIR [--measure]
    python -m bench.simulator project

`--measure` first makes the real runs, one at a time and in rounds (`schedule`), into
DIR/<workload>/<run> (30-35 min on the quiet 2-core machine; `--only tail/async-seed1 ...` makes
just those): five workloads that differ in tool-latency tail, staleness bound, engines and
concurrency. Without it the runs already in DIR are read. The costs are fitted on the first runs of
the calibration workloads (`base`, `pair`) only; the other workloads are predicted out of sample.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.async_vs_sync import run_mode
from bench.machine import machine, settle, speed_probe

REPO = Path(__file__).resolve().parents[1]
LATENCY_S = 0.268  # one assistant turn's generation time, bench/results/async_vs_sync.json's calibration
ENV = {"distribution": "lognormal", "num_turns": 4, "min_turns": 1, "latency_s": LATENCY_S}
WORKLOADS: dict[str, dict[str, Any]] = {
    # `repeats`: runs of the same settings with other seeds (`async-seed1`, ...), for every mode or per
    # mode; one 12- or 20-step run carries a chance spread of up to 8 share points per lag-histogram
    # bin, their mean less. Base's async run is learner-bound at the edge of balance: its learner idle
    # is a handful of one-second waits, 5 in one run and 12 in another, so it is measured three times
    "base": {
        "p99_over_median": 10.0,
        "extra": ("buffer.max_staleness=4",),
        "steps": {"async": 60, "sync": 12},
        "repeats": {"async": 3},
    },
    # calibration only: base with two engines on the cores, for what a second engine process costs
    # the learner beside the first (`LearnerCost.process_frac`); split is validated against it
    "pair": {
        "p99_over_median": 10.0,
        "extra": ("buffer.max_staleness=4", "rollout.num_engines=2"),
        "steps": {"async": 12},
    },
    "tail": {"p99_over_median": 30.0, "extra": ("buffer.max_staleness=1",), "steps": {"async": 20}, "repeats": 3},
    "split": {
        "p99_over_median": 10.0,
        "extra": ("buffer.max_staleness=2", "rollout.num_engines=2"),
        "steps": {"async": 12},
        "repeats": 3,
    },
    # at most 4 trajectories in flight: the engine decodes 0-4 requests (base: 15-30) and idles half the
    # time; measured three times like tail and split (as one run, its throughput missed by -5 to +40 %)
    "narrow": {
        "p99_over_median": 10.0,
        "extra": ("buffer.max_staleness=4", "rollout.max_concurrent_per_worker=4"),
        "steps": {"async": 16},
        "repeats": 3,
    },
}
CALIBRATE_ON = ("base", "pair")  # the workloads whose first run of each mode the costs are fitted on
SPEED_FILE = "machine_speed.json"  # the machine's speed probe (bench.machine) before and after a run, cores quiet
SEEDS = 20  # simulated runs per prediction: their mean, and their spread as the chance variation of one run


def measure(root: Path, only: list[str] | None = None) -> None:
    """Make the real runs into root/<workload>/<run> (`only`: just these `<workload>/<run>` keys), in
    the order of `schedule`."""
    for name, mode, seed, folder in schedule():
        if only and f"{name}/{folder}" not in only:
            continue
        w = WORKLOADS[name]
        (root / name).mkdir(parents=True, exist_ok=True)
        env = {**ENV, "p99_over_median": w["p99_over_median"]}
        extra = (*w["extra"], "rollout.engine.startup_timeout_s=1500")  # start-up on a loaded machine
        settle()
        t0, before = time.time(), speed_probe()
        run_mode(mode, root / name, w["steps"][mode], env, seed=seed, name=folder, extra=extra)
        waited = settle()  # the run's engines and Ray workers leave after its driver
        speed = {"before_ms": before, "after_ms": speed_probe(), "settle_s": waited}
        (root / name / folder / SPEED_FILE).write_text(json.dumps(speed) + "\n")
        print(f"measured {name}/{folder}: {time.time() - t0:.0f} s, {speed}", file=sys.stderr, flush=True)


def schedule() -> list[tuple[str, str, int, str]]:
    """Every run as (workload, mode, seed, folder), in rounds: the first run of every workload and
    mode, then every second run, and so on. This machine's speed drifts over a validation (other users),
    so a workload measured only at its start or only at its end would carry that drift into its
    comparison with the calibration runs; in rounds, each workload's repeats span the validation."""
    runs = [
        (seed, name, mode, folder)
        for name, w in WORKLOADS.items()
        for mode in w["steps"]
        for seed, folder in enumerate(_repeats(w, mode))
    ]
    runs.sort(key=lambda r: r[0])  # stable: within a round, the workloads and their modes keep their order
    return [(name, mode, seed, folder) for seed, name, mode, folder in runs]


def _repeats(workload: dict[str, Any], run: str) -> list[str]:
    """The folders of a run and its repeats: `async`, `async-seed1`, ..."""
    repeats = workload.get("repeats", 1)
    count = repeats.get(run, 1) if isinstance(repeats, dict) else repeats
    return [run] + [f"{run}-seed{s}" for s in range(1, count)]


def validate(root: Path) -> dict[str, Any]:
    """Measured against predicted for every run, twice: with the costs fitted on the calibration
    workload's runs (`base`: a prediction across runs, and across the machine's load, which other
    users change), and with costs fitted on the run itself (the components' speeds as that run saw
    them: what is left to predict is how the pipeline composes them)."""
    from streamrl.sim.calibrate import calibrate, sim_config_of, tool_latency_of
    from streamrl.sim.observe import from_metrics
    from streamrl.sim.validate import compare, mean_measured, measured, predicted, spread_measured

    groups = {  # "<workload>/<run>" -> the folders of the run and of its repeats that exist
        f"{n}/{m}": [root / n / f for f in _repeats(w, m) if (root / n / f).is_dir()]
        for n, w in WORKLOADS.items()
        for m in w["steps"]
    }
    groups = {k: dirs for k, dirs in groups.items() if dirs}
    base = calibrate([dirs[0] for k, dirs in groups.items() if k.split("/")[0] in CALIBRATE_ON])
    table = {}
    for key, dirs in groups.items():
        observed = [from_metrics(d) for d in dirs]
        cfg = sim_config_of(observed[0])
        # the machine's costs from base, the workload's own tool latency (known, not fitted)
        on_base = predicted(cfg, replace(base, tool=tool_latency_of(observed[0].config)), seeds=SEEDS)
        for d, obs in zip(dirs, observed, strict=True):
            own = calibrate([d])
            table[f"{key.split('/')[0]}/{d.name}"] = {
                "in_sample": key.split("/")[0] in CALIBRATE_ON,
                "settings": {"mode": obs.mode, "steps": int(obs.step[-1]), **WORKLOADS[key.split("/")[0]]},
                "learner_step_s_median": float(np.median(obs.step_s[1:])),
                "calibrated_on_base": compare(measured(obs), on_base),
                "calibrated_on_itself": compare(measured(obs), predicted(cfg, own, seeds=SEEDS)),
                "own_costs": own.to_json(),
                **({"machine_speed_ms": speed} if (speed := _speed(d)) else {}),
            }
        if len(dirs) > 1:  # the repeats together: their mean against the same prediction
            runs = [measured(o) for o in observed]
            own, mean, sd = calibrate(dirs), mean_measured(runs), spread_measured(runs)
            table[f"{key} x{len(dirs)}"] = {
                "in_sample": key.split("/")[0] in CALIBRATE_ON,
                "settings": {"mode": cfg.mode, "steps": cfg.total_steps, "runs": [d.name for d in dirs]},
                "learner_step_s_median": float(np.median(np.concatenate([o.step_s[1:] for o in observed]))),
                "calibrated_on_base": compare(mean, on_base, sd, len(dirs)),
                "calibrated_on_itself": compare(mean, predicted(cfg, own, seeds=SEEDS), sd, len(dirs)),
                "own_costs": own.to_json(),
            }
    probes = [v for dirs in groups.values() for d in dirs for k, v in (_speed(d) or {}).items() if k.endswith("_ms")]
    speed = {"min_ms": min(probes), "max_ms": max(probes), "spread": max(probes) / min(probes) - 1} if probes else {}
    return {"costs": base.to_json(), "table": table, **({"machine_speed": speed} if speed else {})}


def _speed(run_dir: Path) -> dict[str, float] | None:
    """The speed probes `measure` took before and after the run (None for runs made without them)."""
    path = run_dir / SPEED_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _record(argv: list[str] | None, t0: float) -> dict[str, Any]:
    return {
        "command": " ".join(["python", "-m", "bench.simulator", *(argv if argv is not None else sys.argv[1:])]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "machine": machine(),
        "wall_s": time.time() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    """`validate` and `project` each write their part of the JSON (they take very different times);
    the figure is drawn once both are there."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="part", required=True)
    v = sub.add_parser("validate", help="measured against predicted on this machine's runs")
    v.add_argument("--runs", required=True, help="folder of the validation runs (<workload>/<mode>)")
    v.add_argument("--measure", action="store_true", help="make the real runs first (~25 min on a quiet machine)")
    v.add_argument("--only", nargs="+", metavar="WORKLOAD/RUN", help="with --measure: make just these runs")
    sub.add_parser("project", help="the cluster projections (published costs)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "simulator.json"))
    args = parser.parse_args(argv)
    out_path = Path(args.out)
    t0 = time.time()
    if args.part == "validate":
        if args.measure:
            measure(Path(args.runs), args.only)
        part = validate(Path(args.runs))
    else:
        from bench.simulator_projections import projections

        part = projections()
    part["run"] = _record(argv, t0)
    out = json.loads(out_path.read_text()) if out_path.exists() else {}  # the other part, as it is now
    out["validation" if args.part == "validate" else "projections"] = part
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    if {"validation", "projections"} <= set(out):
        from bench.simulator_figure import figure

        figure(out, out_path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
