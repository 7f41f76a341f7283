"""What the lifecycle trace costs: the async-vs-sync workload (bench/async_vs_sync.py, async mode)
run with `trace.enabled` on and off, interleaved seed by seed (on/off, then off/on, ...), so slow
drifts of a shared machine hit both sides alike. Writes bench/results/trace_overhead.json.

    python -m bench.trace_overhead [--steps N] [--seeds K] [--latency S] [--out F] [OVERRIDE ...]

OVERRIDEs go to every run alike (e.g. the GPU placement of bench/gpu_session.sh's `trace` step).

Three measures, because a throughput difference of a few percent is within the noise of a short run on
a shared 2-core machine:
- measured: trained samples per hour (steady state, as async_vs_sync counts it), traced over untraced,
  per seed pair;
- in situ: what the traced runs' tracers counted themselves (core.trace's cost counters): the time
  each process spent making and writing events, over that process's traced time. The busiest
  process's share bounds the throughput tracing can take from a pipeline whose slowest part is one
  process;
- accounted: the tracer's seconds per event timed here writing real events to a real shard, times the
  events per second the traced runs recorded, as a share of the machine's cores.
The environment's latency defaults to the calibrated one recorded in bench/results/async_vs_sync.json.
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

from bench.async_vs_sync import CONFIG, REPO, run_mode

RESULT = REPO / "bench" / "results" / "trace_overhead.json"


def traced_config(root: Path, enabled: bool) -> Path:
    """The benchmark's config file with `[trace] enabled` set (a file: overrides would do too, but
    run_mode takes a config, and this keeps the two sides' commands identical but for one line)."""
    path = root / f"bench_trace_{'on' if enabled else 'off'}.toml"
    path.write_text((REPO / CONFIG).read_text() + f"\n[trace]\nenabled = {'true' if enabled else 'false'}\n")
    return path


def event_cost_s(n: int = 20000) -> float:
    """Seconds per recorded event: a span with the args the hot paths pass, into a real shard."""
    from streamrl.core import trace

    with tempfile.TemporaryDirectory(prefix="streamrl-trace-cost-") as tmp:
        trace.configure(tmp)
        t0 = time.perf_counter()
        for i in range(n):
            trace.complete("generate", "trajectory", f"arith-0-{i}@e0/0", time.time(), attempt=0, engine="engine-0")
        cost = (time.perf_counter() - t0) / n
        trace.configure(None)
    return cost


def trace_rate(run_dir: Path) -> dict[str, float]:
    """The events a traced run recorded, and per second of its trace (first event to last: engine
    start-up records nothing, so the run's wall time would understate the rate)."""
    from streamrl.observability.trace_summary import tracer_cost
    from streamrl.observability.tracing import read_trace

    trace = read_trace(run_dir)
    seconds = max((trace.end_us - trace.start_us) / 1e6, 1e-9)
    rate = {"trace_events": len(trace.events), "trace_s": seconds, "events_per_s": len(trace.events) / seconds}
    return rate | {"in_situ": tracer_cost(trace)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12, help="learner steps per run")
    parser.add_argument("--seeds", type=int, default=2, help="seed pairs (one traced and one untraced run each)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first pair's seed (to add pairs)")
    parser.add_argument("--latency", type=float, default=None, help="median environment latency (s)")
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args(argv)
    recorded = json.loads((REPO / "bench" / "results" / "async_vs_sync.json").read_text())["workload"]
    env = dict(recorded["environment"])
    if args.latency is not None:
        env["latency_s"] = args.latency
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    cost = event_cost_s()
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-trace-") as tmp:
        root = Path(tmp)
        configs = {side: traced_config(root, side == "on") for side in ("on", "off")}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for side in ("on", "off") if seed % 2 == 0 else ("off", "on"):
                name = f"trace-{side}-seed{seed}"
                run = run_mode(
                    "async",
                    root,
                    args.steps,
                    env,
                    seed,
                    name=name,
                    config=str(configs[side]),
                    extra=tuple(args.overrides),
                )
                if side == "on":
                    run |= trace_rate(root / name)
                runs[side].append(run)
                print(json.dumps({side: run}), file=sys.stderr, flush=True)
                # after every run: a run cut short by a time limit still leaves what it measured
                out = report(args, argv, env, runs, cost)
                Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("measured", "in_situ", "accounted")}, indent=2))
    return 0


def report(
    args: argparse.Namespace, argv: list[str] | None, env: dict, runs: dict[str, list[dict]], cost: float
) -> dict:
    """The result file's content for the runs made so far (`complete` once every pair is in)."""
    ratios = [
        on["trained_samples_per_hour"] / off["trained_samples_per_hour"] for on, off in zip(runs["on"], runs["off"])
    ]
    traced = runs["on"]
    rates = [r["events_per_s"] for r in traced]
    cpus = os.cpu_count() or 1
    busiest = max(traced, key=lambda r: r["in_situ"]["max_process_share"], default=None)
    return {
        "command": " ".join(["python", "-m", "bench.trace_overhead", *(argv if argv is not None else sys.argv[1:])]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": cpus},
        "load_average_at_end": os.getloadavg(),  # the machine is shared: its load is part of the noise
        "complete": len(ratios) == args.seeds,
        "workload": {
            "config": CONFIG,
            "mode": "async",
            "environment": env,
            "steps": args.steps,
            "seeds": args.seeds,
            "overrides": args.overrides,
        },
        "measured": {
            "throughput_ratio_traced_over_untraced": {
                "per_seed": ratios,
                "mean": statistics.fmean(ratios) if ratios else None,
                "sd": statistics.stdev(ratios) if len(ratios) > 1 else None,
            },
            "overhead_fraction": 1 - statistics.fmean(ratios) if ratios else None,
        },
        "in_situ": {
            "max_process_share": busiest["in_situ"]["max_process_share"] if busiest else None,
            "busiest_process": busiest["in_situ"]["busiest_process"] if busiest else None,
            "us_per_event": statistics.fmean(r["in_situ"]["us_per_event"] for r in traced) if traced else None,
            "processes": [r["in_situ"]["processes"] for r in traced],
        },
        "accounted": {
            "seconds_per_event": cost,
            "events_per_s": statistics.fmean(rates) if rates else None,
            "cpu_share_of_machine": statistics.fmean(rates) * cost / cpus if rates else None,
        },
        "runs": runs,
        "target": "overhead < 2 % of throughput",
    }


if __name__ == "__main__":
    sys.exit(main())
