"""The crash matrix: for each kind of crash, what each promise of docs/invariants.md lost across every
measured run, assembled from the bench's results files (no runs of its own).

    python -m bench.crash_matrix [--out bench/results/crash_matrix.json] [--markdown]

Rows are the crash kinds of docs/durability.md: a rollout worker killed, an engine killed, a
`server_command` engine killed and restarted beside an orphan server, the whole job killed, an
engine preempted (drained on notice), a power loss, a disk error. Columns are what a crash could cost:
prompts skipped or repeated (I1: lost plus duplicated), sampled tokens lost per crash, tool side
effects repeated (I5), gateway answers changed (exactly-once answers), and the other violations the
checker counts (I2 stranded or untracked, I4 version violations, trajectories consumed twice, bad
batches, hangs; for the server engine, orphans adopted and requests to servers the engine did not
start). A cell holds the sum over the runs that had a crash of that kind *and* measured the
quantity (a run without a tool ledger measures no tool effects), with the number of those runs; a
cell no run measured is `null` with the reason, never a zero.

Where a run's crashes come from:
- the kill suite's runs (`results` of chaos.json and its subset files: chaos_*.json): the fault
  points that fired (`fault_counts`; older records: the points armed in each segment) -- `kill_job`
  and the runner's `sigkill_after` are job kills, `kill_self` in `engine.generate` an engine kill,
  every other `kill_self` (the worker's sink, a tool call, the gateway) a worker kill. One run often
  mixes kinds: its counts go to each kind it had;
- `fault_families` of chaos.json: `io` (disk errors), `server_orphan` (server engines), `preempt`;
  chaos_preempt.json: a preemption notice and an engine actor SIGKILLed in one run;
- crash_consistency.json: the power-loss states of a recorded workload (I1 and exactly-once
  consumption, no tools, no gateway);
- progress_loss.json: sampled tokens lost per crash of a worker's process (its in-flight
  generations; a job kill loses each worker's the same way), by `rollout.agent.progress_every_s`;
  progress_loss_engine.json: the same for one of a worker's two engines dying (the worker lives), and
  progress_loss_preempt.json for one drained on a preemption notice;
- the `length_bias` entry of crash_matrix.json (`bench/crash_lengths.py`): a job SIGKILLed twice,
  checked, and its trained lengths compared with an uncrashed run of the same seed (kept as is).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.chaos_families import current_results
from bench.progress_loss import RESULT_FILES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench/results"
KINDS = {
    "worker": "a rollout worker process killed (SIGKILL): worker sink, tool call, gateway call",
    "engine": "an engine actor killed (in generation, or SIGKILLed)",
    "server_engine": "a server_command engine SIGKILLed and restarted on its port while an orphan answers",
    "job": "the whole job killed (driver, learner, buffer): armed kill_job points and timed SIGKILLs",
    "preemption": "an engine preempted on notice (drained, its generations handed to other engines)",
    "power_loss": "a power loss: every state the recorded workload's file operations could leave",
    "disk_error": "ENOSPC, EIO, torn writes and failing fsyncs on the buffer log, checkpoints and run files",
}
OTHER_KEYS = ("stranded", "untracked", "version_violations", "consumed_twice", "bad_batches")
NOT_IN_RUN = "no run of this kind had it (no tool ledger / no gateway clients)"
# why a kind's runs cannot measure the checker's counts at all
NO_CHECKED_RUN = {
    "server_engine": "engine-level case: no training run, so no prompts, tools or gateway",
}


def kill_kinds(run: dict) -> set[str]:
    """The crash kinds a kill-suite run had, from the fault points that fired (else those armed)."""
    if run.get("fault_counts"):
        fired = list(run["fault_counts"])
    else:
        fired = [item.replace("=", " ") for s in run.get("segments", []) for item in (s.get("faults") or "").split(",")]
    kinds = set()
    for point_action in fired:
        point, _, action = point_action.partition(" ")
        if action.startswith("kill_job") or point == "sigkill_after":
            kinds.add("job")
        elif action.startswith("kill_self"):
            kinds.add("engine" if point.startswith("engine.") else "worker")
    if (
        run.get("faults_injected", 0) > sum((run.get("fault_counts") or {}).values())
        and run.get("fault_counts") is not None
    ):
        kinds.add("job")  # the runner's own SIGKILLs (sigkill_after) are not in the fault ledger
    return kinds


def _run_record(source: str, run: dict, kinds: set[str]) -> dict:
    inv = run.get("invariants") or {}
    return {
        "source": source,
        "name": run.get("name"),
        "seed": run.get("seed"),
        "kinds": sorted(kinds),
        "completed": bool(run.get("completed")),
        "hangs": int(run.get("hangs") or 0),
        "prompts_skipped_or_repeated": int(inv.get("prompts_lost") or 0) + int(inv.get("prompts_duplicated") or 0)
        if inv
        else None,
        "tool_effects_repeated": int(inv.get("tool_side_effects_repeated") or 0)
        if inv.get("tool_calls_executed") is not None
        else None,
        "gateway_answers_changed": int(inv.get("gateway_answered_differently") or 0)
        if inv.get("gateway_answers") is not None
        else None,
        "other_violations": {k: int(inv.get(k) or 0) for k in OTHER_KEYS} if inv else None,
    }


def runs_from_results(results: Path = RESULTS) -> list[dict]:
    """Every measured run with the crash kinds it had, from the chaos results files."""
    runs = []
    for path in sorted(results.glob("chaos*.json")):
        data = json.loads(path.read_text())
        for run in data.get("results", []):
            if run.get("name") == "preempt":  # chaos_preempt.json: a preemption and an engine SIGKILL
                kinds = {"preemption"} | ({"engine"} if run.get("engines_killed") else set())
                runs.append(_run_record(path.name, run, kinds))
            elif kinds := kill_kinds(run):
                runs.append(_run_record(path.name, run, kinds))
        for run in current_results(data):  # a re-run of a (family, seed) replaces the older run
            if run.get("name") == "io":
                runs.append(_run_record(f"{path.name} fault_families", run, {"disk_error"}))
            elif run.get("name") == "preempt":
                kinds = {"preemption"} | ({"engine"} if run.get("engines_killed") else set())
                runs.append(_run_record(f"{path.name} fault_families", run, kinds))
            elif run.get("name") == "server_orphan":
                record = _run_record(f"{path.name} fault_families", run, {"server_engine"})
                record["other_violations"] = {
                    "orphans_adopted": int(run.get("orphans_adopted") or 0),
                    "requests_to_foreign_servers": int(run.get("requests_to_foreign_servers") or 0),
                }
                runs.append(record)
    lengths = _read(results / "crash_matrix.json").get("length_bias") or {}
    crashed = (lengths.get("runs") or {}).get("crashed")
    if crashed:
        runs.append(_run_record("crash_matrix.json length_bias", crashed, {"job"}))
    return runs


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _sum_cell(runs: list[dict], key: str, why_not: str) -> dict:
    measured = [r[key] for r in runs if r[key] is not None]
    if not measured:
        return {"value": None, "runs": 0, "not_measured": why_not}
    if isinstance(measured[0], dict):
        total: dict[str, int] = {}
        for m in measured:
            for k, v in m.items():
                total[k] = total.get(k, 0) + v
        return {"value": total, "runs": len(measured)}
    return {"value": sum(measured), "runs": len(measured)}


# which crash of the progress bench (`--crash`) stands for each kind: a job kill loses each worker's
PROGRESS_CRASH = {"worker": "worker", "job": "worker", "engine": "engine", "preemption": "preempt"}


def tokens_lost_cell(kind: str, progress: dict[str, dict]) -> dict:
    """Sampled tokens lost per crash, from the progress bench's result for the process that crashed
    (`progress`: by crashed process): a worker's (which a job kill repeats for each worker) or an
    engine's; no other kind has been measured."""
    crashed = PROGRESS_CRASH.get(kind)
    result = (progress.get(crashed) or {}) if crashed else {}
    summary = result.get("summary") or {}
    if not summary:
        return {"value": None, "runs": 0, "not_measured": "no bench counts the tokens in flight at this crash"}
    return {
        "value": {name: round(s["tokens_lost_mean"], 1) for name, s in summary.items()},
        "per_running_trajectory": {name: round(s["tokens_lost_per_trajectory"], 1) for name, s in summary.items()},
        "runs": len(result.get("trials") or []),
        "by": "rollout.agent.progress_every_s (off: no progress rows)",
        "source": f"{RESULT_FILES[crashed]}: "
        + result.get("command", "")
        + f" ({result.get('model')}, real vLLM engine and worker, the {crashed} crashed at a seeded moment)",
    }


def power_loss_row(crash: dict) -> dict:
    """The power-loss row from the crash-consistency check (I1 and exactly-once consumption only)."""
    if not crash:
        return {}
    problems = int(crash.get("num_problems", 0))
    return {
        "runs": [{"source": "crash_consistency.json", "states_checked": crash.get("num_states_checked")}],
        "prompts_skipped_or_repeated": {
            "value": problems,
            "runs": 1,
            "states_checked": crash.get("num_states_checked"),
            "note": "problems found: a prompt below the saved cursor without its group, a consumed group handed "
            "out again, an acknowledged group lost or changed",
        },
        "tokens_lost_per_crash": {
            "value": None,
            "runs": 0,
            "not_measured": "the recorded workload has no engine; rows only flushed since the last checkpoint may go",
        },
        "tool_effects_repeated": {"value": None, "runs": 0, "not_measured": "the recorded workload runs no tools"},
        "gateway_answers_changed": {"value": None, "runs": 0, "not_measured": "the recorded workload has no gateway"},
        "other_violations": {
            "value": {"problems": problems},
            "runs": 1,
            "states_checked": crash.get("num_states_checked"),
            "note": "the same check: also a torn newest checkpoint resumed, a driver_state.json neither old nor new",
        },
    }


def build(results: Path = RESULTS) -> dict:
    runs = runs_from_results(results)
    progress = {crashed: _read(results / name) for crashed, name in RESULT_FILES.items()}
    crash = _read(results / "crash_consistency.json")
    matrix = {}
    for kind, what in KINDS.items():
        if kind == "power_loss":
            matrix[kind] = {"what": what, **power_loss_row(crash)}
            continue
        mine = [r for r in runs if kind in r["kinds"]]
        unchecked = NO_CHECKED_RUN.get(kind)
        matrix[kind] = {
            "what": what,
            "runs": [{k: r[k] for k in ("source", "name", "seed", "completed")} for r in mine],
            "prompts_skipped_or_repeated": _sum_cell(
                mine, "prompts_skipped_or_repeated", unchecked or "no checked run"
            ),
            "tokens_lost_per_crash": tokens_lost_cell(kind, progress),
            "tool_effects_repeated": _sum_cell(mine, "tool_effects_repeated", unchecked or NOT_IN_RUN),
            "gateway_answers_changed": _sum_cell(mine, "gateway_answers_changed", unchecked or NOT_IN_RUN),
            "other_violations": _sum_cell(mine, "other_violations", "no checked run"),
            "hangs": sum(r["hangs"] for r in mine),
            "completed": sum(r["completed"] for r in mine),
        }
    return {"matrix": matrix}


COLUMNS = (
    ("prompts_skipped_or_repeated", "prompts skipped or repeated"),
    ("tokens_lost_per_crash", "sampled tokens lost per crash"),
    ("tool_effects_repeated", "tool effects repeated"),
    ("gateway_answers_changed", "gateway answers changed"),
    ("other_violations", "other violations"),
)


def cell_text(cell: dict) -> str:
    if not cell or cell.get("value") is None:
        return "not measured"
    value = cell["value"]
    if isinstance(value, dict):
        if all(isinstance(v, float) for v in value.values()):  # tokens by setting
            return ", ".join(f"{v:,.0f} ({k})" for k, v in value.items())
        value = sum(value.values())
    runs = cell.get("states_checked") or cell["runs"]
    unit = "states" if "states_checked" in cell else ("run" if runs == 1 else "runs")
    return f"{value:,} ({runs:,} {unit})"


def markdown(matrix: dict) -> str:
    """The matrix as the table of docs/durability.md."""
    lines = [
        "| crash | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for kind, row in matrix.items():
        cells = [cell_text(row.get(key, {})) for key, _ in COLUMNS]
        lines.append(f"| {kind.replace('_', ' ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "crash_matrix.json"))
    parser.add_argument("--markdown", action="store_true", help="print the matrix as a markdown table")
    args = parser.parse_args(argv)
    out = Path(args.out)
    data = _read(out)
    data = {
        "command": "python -m bench.crash_matrix " + " ".join(argv if argv is not None else sys.argv[1:]),
        **build(),
        **({"length_bias": data["length_bias"]} if "length_bias" in data else {}),
    }
    out.write_text(json.dumps(data, indent=1))
    print(markdown(data["matrix"]) if args.markdown else json.dumps(data["matrix"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
