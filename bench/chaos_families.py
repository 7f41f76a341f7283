"""The chaos bench's fault families beyond kills, and its summary by kind of fault.

    python -m bench.chaos --families io,hostile,all_fail,server_orphan [--seeds 1] [--first-seed 0]
                          [--keep DIR]

runs the I/O-fault family (`bench/chaos_io.py`: buffer logs, checkpoints, run files), the
hostile-callback families (`bench/chaos_hostile.py`: hostile rewards and tools, a run whose every
trajectory fails) and the server-engine family (`bench/chaos_server_orphan.py`: a `server_command`
engine killed and restarted on its port while an orphan answers there) and appends one entry to
`fault_families` in bench/results/chaos.json (earlier entries and the kill suite's results are kept).
`by_kind` is then rebuilt from everything the file and its neighbours hold: kills and other armed
faults (the kill suite's results), I/O faults, hostile callbacks and server-engine cases (every
`fault_families` entry: each holds its own runs, e.g. another seed via `--first-seed`), power-loss
states checked (`bench/results/crash_consistency.json`), the sampled tokens a crash loses with and
without durable generation progress (`bench/results/progress_loss.json`) and fuzz cases (the
`max_examples` of every test under tests/fuzz, read from the source, not re-run).
"""

from __future__ import annotations

import ast
import json
import os
import platform
import subprocess
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from streamrl.core import syntax
from streamrl.core.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("io", "hostile", "all_fail", "preempt", "server_orphan")  # bench/chaos_preempt.py, chaos_server_orphan.py
LOSS_KEYS = (
    "prompts_lost",
    "prompts_duplicated",
    "consumed_twice",
    "bad_batches",
    "version_violations",
    "tool_side_effects_repeated",
    "gateway_answered_differently",
)


def run_io(seed: int, root: Path, timeout_s: float) -> dict:
    from bench.chaos import run_scenario
    from bench.chaos_io import hard_faults_by_target, injected_faults, io_segments, summarize_io

    result = run_scenario("io", seed, [], root, timeout_s=timeout_s, io_faults=io_segments(seed))
    run_dir = root / f"io-s{seed}"
    return {
        **asdict(result),
        **summarize_io(injected_faults(run_dir), result.segments, hard_faults_by_target(run_dir)),
    }


def run_hostile(seed: int, root: Path, timeout_s: float) -> list[dict]:
    """The mixed hostile-reward run, then the tool hostilities and the decompression bomb on the real
    tool executor (unit-level; see bench/chaos_hostile.py)."""
    from bench.chaos import run_scenario
    from bench.chaos_hostile import hostile_report, image_bomb_check, tool_check

    hostile = run_scenario("hostile", seed, [""], root, timeout_s=timeout_s, max_clean=0)
    run_dir = root / f"hostile-s{seed}"
    report = hostile_report(run_dir, root / f"hostile-s{seed}.log") if RunDir(run_dir).buffer.exists() else {}
    out = [{**asdict(hostile), **report}]
    out.append({"name": "hostile_tools", "seed": seed, **tool_check()})
    bomb_dir = root / f"image_bomb-s{seed}"
    bomb_dir.mkdir(exist_ok=True)
    out.append(
        {
            "name": "image_bomb",
            "seed": seed,
            "level": "unit (real ToolRegistry + ImageStore, no run)",
            **image_bomb_check(bomb_dir),
        }
    )
    return out


def run_all_fail(seed: int, root: Path, timeout_s: float) -> dict:
    """Every reward NaN: one segment, no resume: stopping with a clear error is the expected outcome."""
    from bench.chaos import OVERRIDES, _segment
    from bench.chaos_hostile import ALL_FAIL_OVERRIDES, all_fail_report
    from streamrl.streaming.invariants import check_run

    log = root / f"all_fail-s{seed}.log"
    args = [
        "--config",
        "configs/tiny.toml",
        f"trainer.run_root={root}",
        f"trainer.run_name=all_fail-s{seed}",
        f"trainer.seed={seed}",
        *OVERRIDES,
        *ALL_FAIL_OVERRIDES,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("RAY_ADDRESS", None)
    rc, wall, _ = _segment(args, env, log, timeout_s)
    run_dir = root / f"all_fail-s{seed}"
    report = all_fail_report(rc, log.read_text(errors="replace"), run_dir)
    invariants = asdict(check_run(run_dir)) if RunDir(run_dir).driver_state.exists() else {}
    return {
        "name": "all_fail",
        "seed": seed,
        "wall_s": round(wall, 1),
        "hangs": int(rc is None),
        **report,
        "invariants": invariants,
    }


def recheck(out_path: Path, runs: Path) -> dict:
    """Recount the newest `fault_families` entry from its kept run directories (`--keep`) with this
    checkout's counters and checker; the counts the run wrote are kept as `at_run`."""
    from bench.chaos_hostile import all_fail_report, hostile_report
    from bench.chaos_io import hard_faults_by_target, injected_faults, summarize_io
    from streamrl.streaming.invariants import check_run

    data = json.loads(out_path.read_text())
    entry = data["fault_families"][-1]
    for r in entry["results"]:
        run_dir = runs / f"{r['name']}-s{r['seed']}"
        if not RunDir(run_dir).driver_state.exists():
            continue
        fresh = {"invariants": asdict(check_run(run_dir))}
        if r["name"] == "io":
            fresh |= summarize_io(injected_faults(run_dir), r["segments"], hard_faults_by_target(run_dir))
        elif r["name"] == "hostile":
            fresh |= hostile_report(run_dir, runs / f"{r['name']}-s{r['seed']}.log")
        elif r["name"] == "all_fail":
            output = (runs / f"{r['name']}-s{r['seed']}.log").read_text(errors="replace")
            fresh |= all_fail_report(r["rc"], output, run_dir)
        r.setdefault("at_run", {k: r.get(k) for k in fresh if r.get(k) != fresh[k]})
        r |= fresh
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    entry["rechecked"] = {"runs": str(runs), "checker_commit": commit.strip()}
    out_path.write_text(json.dumps(data, indent=1))
    return write_by_kind(out_path)


def fuzz_cases(fuzz_dir: Path = REPO / "tests/fuzz") -> dict[str, int]:
    """test -> its `@settings(max_examples=N)` (hypothesis runs at most N examples per run)."""
    cases = {}
    for path in sorted(fuzz_dir.glob("test_*.py")):
        for node in ast.walk(syntax.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "settings":
                    for kw in deco.keywords:
                        if kw.arg == "max_examples" and isinstance(kw.value, ast.Constant):
                            cases[f"{path.name}::{node.name}"] = int(kw.value.value)
    return cases


def server_orphan_counts(family_results: list[dict]) -> dict:
    """The `server_orphan` cases summed: engines killed, orphans adopted and requests (generations,
    weight calls) that reached a server the sending engine did not start (both must be 0)."""
    cases = [r for r in family_results if r.get("name") == "server_orphan"]
    total = lambda key: sum(int(r.get(key) or 0) for r in cases)  # noqa: E731
    return {
        "cases": len(cases),
        "completed": sum(bool(r.get("completed")) for r in cases),
        "kills": total("faults_injected"),
        "orphans_adopted": total("orphans_adopted"),
        "requests_to_foreign_servers": total("requests_to_foreign_servers"),
        "refused_clearly": total("refused_clearly"),
    }


def tokens_lost_per_crash(progress: dict | None) -> dict:
    """Sampled tokens a crash loses (mean over crash moments), per `progress_every_s` setting, from
    bench/results/progress_loss.json: "off" is without durable generation progress."""
    if not progress:
        return {}
    return {
        setting: {
            "tokens_lost": round(s["tokens_lost_mean"], 1),
            "per_running_trajectory": round(s["tokens_lost_per_trajectory"], 1),
            "share_of_sampled": round(s["lost_share"], 3),
            "sampled_tokens_per_s": round(s["sampled_tokens_per_s"], 1),
        }
        for setting, s in progress.get("summary", {}).items()
    }


def supersede(entries: list[dict]) -> None:
    """Mark each family result that a later entry re-ran (same name, same seed) `superseded_by` that
    entry's index: `by_kind` counts the newest run of a (family, seed) only, and the older one stays in
    the file as history."""
    newest: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(entries):
        for r in entry.get("results", []):
            newest[(r.get("name"), r.get("seed"))] = i
    for i, entry in enumerate(entries):
        for r in entry.get("results", []):
            later = newest[(r.get("name"), r.get("seed"))]
            if later != i:
                r["superseded_by"] = later


def current_results(data: dict) -> list[dict]:
    """Every family result no later entry re-ran (`supersede`)."""
    return [r for entry in data.get("fault_families", []) for r in entry.get("results", []) if "superseded_by" not in r]


def armed_faults(results: list[dict]) -> tuple[dict[str, int], int]:
    """The kill suite's fired faults by action, and the faults of results recorded before per-point
    counts (kills, raises, delays in one number), which no action can claim."""
    kill_actions: dict[str, int] = {}
    unsplit = 0
    for r in results:
        if "fault_counts" not in r:
            killed = sum(s.get("rc") == -9 for s in r["segments"])  # each such segment took at least one kill
            kill_actions["segment_killed"] = kill_actions.get("segment_killed", 0) + killed
            unsplit += r["faults_injected"] - killed
            continue
        fired = r["fault_counts"]
        for point_action, n in fired.items():
            action = point_action.split()[-1]
            action = "delay" if action.startswith("delay") else action
            kill_actions[action] = kill_actions.get(action, 0) + n
        kill_actions["runner_sigkill"] = (
            kill_actions.get("runner_sigkill", 0) + r["faults_injected"] - sum(fired.values())
        )
    return kill_actions, unsplit


def io_counts(io: list[dict]) -> dict:
    """The `io` family's injected faults: in all, hard, short writes, by kind and by target."""
    return {
        "io_faults": sum(r["io_faults_injected"] for r in io),
        "io_hard_faults": sum(r["io_hard_faults"] for r in io),
        "io_short_writes": sum(r["io_short_writes"] for r in io),
        "io_faults_by_kind": dict(
            sorted(sum((Counter(r.get("io_faults_by_kind", {})) for r in io), Counter()).items())
        ),
        # hard faults on buffer logs, checkpoints and run files (entries from before targets: buffer)
        "io_hard_faults_by_target": dict(
            sum(
                (Counter(r.get("io_hard_faults_by_target") or {"buffer": r["io_hard_faults"]}) for r in io),
                Counter(),
            )
        ),
    }


def _nonzero(invariants: dict) -> dict:
    return {k: v for k, v in invariants.items() if k in (*LOSS_KEYS, "stranded", "untracked") and v}


def losses_and_violations(data: dict, family_results: list[dict], orphan: dict) -> tuple[dict, list[dict]]:
    """Every loss and violation count summed over the kill suite and the current family results, and
    where each non-zero count comes from: (fault_families entry, its commit, run, seed, counts)."""
    runs = [*data.get("results", []), *family_results]
    invariants = [r.get("invariants") or {} for r in runs]
    losses = {key: sum(int(inv.get(key) or 0) for inv in invariants) for key in LOSS_KEYS}
    losses["stranded"] = sum(int(inv.get("stranded") or 0) + int(inv.get("untracked") or 0) for inv in invariants)
    losses["hangs"] = sum(int(r.get("hangs") or 0) for r in runs)
    losses["orphans_adopted"] = orphan["orphans_adopted"]
    losses["requests_to_foreign_servers"] = orphan["requests_to_foreign_servers"]
    sources = [
        {"entry": i, "commit": entry.get("commit"), "name": r["name"], "seed": r.get("seed"), "counts": counts}
        for i, entry in enumerate(data.get("fault_families", []))
        for r in entry.get("results", [])
        if "superseded_by" not in r and (counts := _nonzero(r.get("invariants") or {}))
    ]
    return losses, sources


def by_kind(data: dict, crash: dict | None, fuzz: dict[str, int], progress: dict[str, dict] | None = None) -> dict:
    """Faults by kind over the kill suite, the newest family entry, the power-loss simulator and the
    fuzzers, with every loss and violation count summed over the runs that report them. `progress`:
    the progress bench's result per crashed process ("worker", "engine")."""
    kill_actions, unsplit = armed_faults(data.get("results", []))
    family_results = current_results(data)
    orphan = server_orphan_counts(family_results)
    losses, sources = losses_and_violations(data, family_results, orphan)
    return {
        "kills": sum(kill_actions.get(k, 0) for k in ("kill_job", "kill_self", "runner_sigkill", "segment_killed")),
        "other_armed_faults": {k: v for k, v in kill_actions.items() if k in ("raise", "delay")},
        # armed faults of older records not split by kind: worker kills, sink raises, delays, failing syncs
        "armed_faults_not_split_by_kind": unsplit,
        **io_counts([r for r in family_results if r.get("name") == "io"]),
        "power_loss_states_checked": (crash or {}).get("num_states_checked", 0),
        "power_loss_crash_points_checked": (crash or {}).get("num_crash_points_checked", 0),
        "fuzz_cases": sum(fuzz.values()),
        "hostile_callbacks": sum(r["hostile_callbacks"] for r in family_results if "hostile_callbacks" in r),
        "server_orphan": orphan,
        "tokens_lost_per_crash": {kind: tokens_lost_per_crash(p) for kind, p in (progress or {}).items() if p},
        "losses_and_violations": losses,
        "losses_and_violations_from": sources,
        "sources": {
            "kills": "results (kill suite): per point and action; for results recorded without "
            "per-point counts, the segments that died by SIGKILL (a lower bound)",
            "io_faults, hostile_callbacks": "every entry of fault_families (each its own runs and seeds)",
            "power_loss": "bench/results/crash_consistency.json (num_states_checked)",
            "fuzz_cases": "max_examples of tests/fuzz/*.py (upper bound per run, not re-run)",
            "server_orphan": "every server_orphan entry of fault_families (engine processes, a recording stand-in "
            "for vllm serve)",
            "tokens_lost_per_crash": "bench/results/progress_loss.json (worker), progress_loss_engine.json "
            "(engine) and progress_loss_preempt.json (preempt): a real worker and engine, SmolLM2, 16 trajectories "
            "in flight, the worker's process or one of its two engines crashed (or drained on notice) at a seeded "
            "moment; by rollout.agent.progress_every_s",
        },
        "fuzz_cases_by_test": fuzz,
    }


def write_by_kind(out_path: Path) -> dict:
    data = json.loads(out_path.read_text()) if out_path.exists() else {}
    crash_path = REPO / "bench/results/crash_consistency.json"
    crash = json.loads(crash_path.read_text()) if crash_path.exists() else None
    from bench.progress_loss import RESULT_FILES

    paths = {crashed: REPO / "bench/results" / name for crashed, name in RESULT_FILES.items()}
    progress = {crashed: json.loads(path.read_text()) for crashed, path in paths.items() if path.exists()}
    data["by_kind"] = by_kind(data, crash, fuzz_cases(), progress)
    out_path.write_text(json.dumps(data, indent=1))
    return data["by_kind"]


def main(
    families: list[str],
    seeds: int,
    root: Path,
    out_path: Path,
    argv: list[str],
    timeout_s: float = 900.0,
    first_seed: int = 0,
) -> int:
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown families {sorted(unknown)}; known: {list(FAMILIES)}")
    t0 = time.monotonic()

    def head() -> str:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()

    commit_at_start = head()
    results: list[dict] = []
    for seed in range(first_seed, first_seed + seeds):
        if "io" in families:
            results.append(run_io(seed, root, timeout_s))
            print(json.dumps({k: results[-1].get(k) for k in ("name", "io_faults_injected", "completed")}), flush=True)
        if "hostile" in families:
            results += run_hostile(seed, root, timeout_s)
            print(json.dumps({k: results[-3].get(k) for k in ("name", "hostile_callbacks", "completed")}), flush=True)
        if "preempt" in families:
            from bench.chaos_preempt import run_preempt

            results.append(run_preempt(seed, root, timeout_s))
        if "server_orphan" in families:
            from bench.chaos_server_orphan import run_server_orphan

            results.append(run_server_orphan(seed, root))
            shown = ("name", "orphans_adopted", "requests_to_foreign_servers", "refused_clearly")
            print(json.dumps({k: results[-1].get(k) for k in shown}), flush=True)
        if "all_fail" in families:
            results.append(run_all_fail(seed, root, timeout_s))
            print(json.dumps({k: results[-1].get(k) for k in ("name", "stopped_clearly", "rc")}), flush=True)
    entry = {
        "command": "python -m bench.chaos " + " ".join(argv),
        "commit": commit_at_start,  # each segment runs the working tree as it is when it starts
        "commit_at_end": head(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - (time.monotonic() - t0))),
        "wall_s": round(time.monotonic() - t0, 1),
        "results": results,
    }
    data = json.loads(out_path.read_text()) if out_path.exists() else {}
    data.setdefault("fault_families", []).append(entry)
    supersede(data["fault_families"])
    out_path.write_text(json.dumps(data, indent=1))
    print(json.dumps(write_by_kind(out_path), indent=1))
    return 0
