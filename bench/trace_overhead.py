"""What the lifecycle trace costs: the async-vs-sync workload (bench/async_vs_sync.py, async mode)
run with `trace.enabled` on and off, interleaved seed by seed (on/off, then off/on, ...), so slow
drifts of a shared machine hit both sides alike. Writes bench/results/trace_overhead.json.

    python -m bench.trace_overhead [--steps N] [--seeds K] [--latency S] [--out F] [OVERRIDE ...]
    python -m bench.trace_overhead --reader-memory [--trace-mb 80] [--before REV] [--out F]

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

`--reader-memory` measures the readers instead: the peak RSS of `streamrl trace` and of the report's
timeline, each in a fresh process, on a synthetic trace of `--trace-mb` (`synthetic_trace`), for this
checkout and, with `--before REV`, for the readers of commit REV; it sets the result file's
`reader_memory` key and keeps the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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


def synthetic_trace(run_dir: Path, num_bytes: int, *, num_engines: int = 2, seed: int = 0) -> int:
    """Write a trace shaped like a real run's into RUN_DIR/trace/ until it holds `num_bytes`; returns
    the bytes written. Its shards are the processes a run has (driver, engines, two rollout workers,
    buffer, learner), each with the events its part records (core.trace) and a cost counter every
    `COST_EVERY` lines: trajectories of four turns (admitted, queued, generate / tool per turn,
    appended, sampled, trained), a learner step with a weight sync every 64 trajectories, and the
    engines' busy spans between syncs. The readers' memory checks use it (a real run of this size
    takes hours)."""
    from streamrl.core.run_dir import RunDir
    from streamrl.core.trace import COST_EVERY, TRACER

    folder = RunDir(run_dir).trace
    folder.mkdir(parents=True, exist_ok=True)
    names = ["driver", *(f"engine-{i}" for i in range(num_engines)), "worker-0", "worker-1", "buffer", "learner"]
    files = {name: open(folder / f"node-{i + 100}.jsonl", "w", encoding="utf-8") for i, name in enumerate(names)}
    lines = dict.fromkeys(names, 0)
    first: dict[str, int] = {}
    rng = random.Random(seed)
    written = 0
    t0 = 1_700_000_000 * 1_000_000

    def emit(shard: str, event: dict) -> None:
        nonlocal written
        line = json.dumps(event, separators=(",", ":")) + "\n"
        files[shard].write(line)
        written += len(line)
        lines[shard] += 1
        first.setdefault(shard, event["ts"])
        if lines[shard] % COST_EVERY == 0:
            track = f"node-{names.index(shard) + 100}"
            args = {"events": lines[shard], "cost_us": lines[shard] * 7, "since_us": first[shard]}
            counter = {"ph": "C", "name": f"{TRACER} {track}", "cat": TRACER, "ts": event["ts"], "pid": TRACER}
            files[shard].write(json.dumps(counter | {"tid": track, "args": args}, separators=(",", ":")) + "\n")

    def span(shard: str, name: str, pid: str, tid: str, ts: int, dur: int, **args: object) -> None:
        emit(shard, {"ph": "X", "name": name, "cat": pid, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args})

    def point(shard: str, name: str, tid: str, ts: int, **args: object) -> None:
        event = {"ph": "i", "s": "t", "name": name, "cat": "trajectory", "ts": ts, "pid": "trajectory", "tid": tid}
        emit(shard, event | {"args": args})

    k = 0
    try:
        while written < num_bytes:
            step = version = k // 64
            tid, worker, engine = f"arith-{k}-0@e0/{k % 8}", f"worker-{k % 2}", f"engine-{k % num_engines}"
            at = t0 + k * 50_000
            point("driver", "admitted", tid, at, attempt=0)
            span(worker, "queued", "trajectory", tid, at, 2_000, attempt=0)
            at += 2_000
            for _ in range(4):
                dur = rng.randint(20_000, 400_000)
                args = {"attempt": 0, "engine": engine, "min_version": version, "max_version": version}
                span(worker, "generate", "trajectory", tid, at, dur, **args, tokens=rng.randint(8, 256), aborted=False)
                span(worker, "tool", "trajectory", tid, at + dur, 5_000, attempt=0, calls=1)
                at += dur + 5_000
            point("buffer", "appended", tid, at, status="finished", min_version=version, max_version=version)
            point("buffer", "sampled", tid, at + 1_000_000, learner_step=step + 1)
            point("learner", "trained", tid, at + 2_000_000, learner_step=step + 1, lag=0)
            if k % 64 == 63:  # the engines idle through the step's weight sync: their busy spans end
                for i in range(num_engines):
                    span(f"engine-{i}", "busy", "engine", f"engine-{i}", at - 3_100_000, 3_100_000, requests=64)
                span("learner", "train_step", "learner", "learner", at, 1_500_000, learner_step=step + 1)
                span("driver", "train_step", "driver", "driver", at, 1_500_000, learner_step=step + 1)
                span("learner", "sync", "sync", "sync", at + 1_500_000, 300_000, policy_version=version + 1)
                span("learner", "paused", "sync", "sync", at + 1_600_000, 100_000, policy_version=version + 1)
            k += 1
    finally:
        for f in files.values():
            f.close()
    return written


# Run in a fresh process by `reader_peak_rss`: argv = reader, small run dir, big run dir.
_READ = """
import contextlib, io, json, resource, sys
from pathlib import Path


def read(run_dir):
    with contextlib.redirect_stdout(io.StringIO()):
        if sys.argv[1] == "cli":
            from streamrl.streaming.cli import main

            assert main(["trace", run_dir, "--json"]) == 0
        else:
            from streamrl.observability.report_timeline import timeline_blocks

            problems = []
            assert timeline_blocks(Path(run_dir), problems) and not problems, problems


read(sys.argv[2])  # imports and lazy set-up paid on a small trace first
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
read(sys.argv[3])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"baseline_rss_mb": baseline / 1024, "peak_rss_mb": peak / 1024}))
"""
READERS = ("cli", "report")  # `streamrl trace RUN_DIR --json` (merge + summary), the report's timeline


def reader_peak_rss(reader: str, small: Path, big: Path, *, code_root: Path | None = None) -> dict[str, float]:
    """Peak RSS (MB) of a fresh process running `reader` (`READERS`) on the trace of `big`, and its
    baseline: the peak after a first read of `small`, which pays the imports and the lazy set-up.
    `code_root`: a folder holding another checkout as `streamrl/` (to measure an older reader)."""
    env = dict(os.environ)
    if code_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code_root), env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-c", _READ, reader, str(small), str(big)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {reader} reader failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def reader_memory(trace_mb: float, before: str | None, argv: list[str]) -> dict:
    """Peak RSS and wall time of each reader on one synthetic trace, now and at commit `before`."""
    with tempfile.TemporaryDirectory(prefix="streamrl-trace-read-") as tmp:
        root = Path(tmp)
        small, big = root / "small", root / "big"
        synthetic_trace(small, 200_000)
        size = synthetic_trace(big, int(trace_mb * 1e6))
        sides: dict[str, Path | None] = {"after": None}
        if before is not None:
            code = root / "before" / "streamrl"
            code.mkdir(parents=True)
            archive = subprocess.run(["git", "archive", before], cwd=REPO, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
            sides = {"before": code.parent, **sides}
        readers: dict[str, dict[str, dict[str, float]]] = {}
        for side, code_root in sides.items():
            for reader in READERS:
                started = time.monotonic()
                rss = reader_peak_rss(reader, small, big, code_root=code_root)
                rss |= {"wall_s": time.monotonic() - started, "grown_mb": rss["peak_rss_mb"] - rss["baseline_rss_mb"]}
                readers.setdefault(side, {})[reader] = rss
                print(json.dumps({side: {reader: rss}}), file=sys.stderr, flush=True)
    git = ["git", "rev-parse", "HEAD"]
    return {
        "command": " ".join(["python", "-m", "bench.trace_overhead", *argv]),
        "commit": subprocess.run(git, cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "before_commit": before,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "load_average_at_end": os.getloadavg(),
        "trace": {"bytes": size, "shape": "bench.trace_overhead.synthetic_trace: 7 shards, 4-turn trajectories"},
        "readers": {"cli": "streamrl trace RUN_DIR --json", "report": "the report's lifecycle timeline"},
        "measure": "peak RSS of a fresh process (ru_maxrss) after reading the trace; baseline: after a 0.2 MB one",
        "results": readers,
    }


def trace_rate(run_dir: Path) -> dict[str, float]:
    """The events a traced run recorded, and per second of its trace (first event to last: engine
    start-up records nothing, so the run's wall time would understate the rate)."""
    from streamrl.observability.trace_summary import trace_totals, tracer_cost
    from streamrl.observability.tracing import open_trace

    totals = trace_totals(open_trace(run_dir))
    seconds = max((totals.end_us - totals.start_us) / 1e6, 1e-9)
    rate = {"trace_events": totals.num_events, "trace_s": seconds, "events_per_s": totals.num_events / seconds}
    return rate | {"in_situ": tracer_cost(totals)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12, help="learner steps per run")
    parser.add_argument("--seeds", type=int, default=2, help="seed pairs (one traced and one untraced run each)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first pair's seed (to add pairs)")
    parser.add_argument("--latency", type=float, default=None, help="median environment latency (s)")
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--reader-memory", action="store_true", help="measure the readers' peak RSS instead")
    parser.add_argument("--trace-mb", type=float, default=80.0, help="--reader-memory: the synthetic trace's size")
    parser.add_argument("--before", default=None, help="--reader-memory: also measure the readers of this commit")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args(argv)
    if args.reader_memory:
        result = reader_memory(args.trace_mb, args.before, argv if argv is not None else sys.argv[1:])
        out = Path(args.out)
        kept = json.loads(out.read_text()) if out.exists() else {}
        out.write_text(json.dumps(kept | {"reader_memory": result}, indent=2) + "\n")
        print(json.dumps(result["results"], indent=2))
        return 0
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
