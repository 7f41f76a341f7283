"""Check a finished run against the async invariants (docs/invariants.md, "The async invariants") from what is
durable only: the buffer's log and the files of the run directory. The chaos suite runs it after
every scenario; `python -m streamrl.streaming.invariants RUN_DIR` prints the report.

Counts (all must be 0): prompts lost (I1: one of the first `cursor` prompts has no rows, and the
prompt filter's skips saved with the cursor do not explain it), prompts duplicated (a group beyond
the cursor, or with more than `group_size` trajectories), trajectories consumed twice or outside a
learner step's full batch, stranded trajectories (I2, from the end-of-run accounting), version
violations (I4: a trajectory whose versions decrease, or a label above the high-water mark the
driver saved, or a sampled token labelled below 0: weights no sync published), tool side effects
repeated (I5: when the run's tools keep a ledger at `RUN_DIR/tool_ledger.jsonl`
(`workloads.tools.ledger`), a (trajectory, call id) with more than one line, or a finished trajectory
with more ledger lines than tool calls), gateway calls answered differently (exactly-once answers:
when the run's gateway clients record what they were told at `RUN_DIR/answer_ledger.jsonl`
(`workloads.answer_ledger`), a journal key whose clients got more than one distinct answer; also
counted across attempts, a restarted program's repeats included).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.core.run_dir import RunDir
from streamrl.streaming.driver_state import DriverState

if TYPE_CHECKING:
    import pandas as pd

    from streamrl.streaming.config import StreamRLConfig


@dataclass(kw_only=True)
class InvariantReport:
    run_dir: str
    learner_step: int = 0
    cursor: int = 0
    prompts_lost: int = 0
    prompts_duplicated: int = 0
    consumed_twice: int = 0
    bad_batches: int = 0  # learner steps whose batch is not one full batch
    stranded: int | None = None  # None: the run ended without its accounting (killed)
    untracked: int | None = None
    version_violations: int = 0
    tool_calls_executed: int | None = None  # ledger lines; None: the run's tools keep no ledger
    tool_side_effects_repeated: int = 0
    gateway_answers: dict | None = None  # the answer ledger's counts; None: no gateway clients recorded
    gateway_answered_differently: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        counts = (
            self.prompts_lost,
            self.prompts_duplicated,
            self.consumed_twice,
            self.bad_batches,
            self.stranded or 0,
            self.untracked or 0,
            self.version_violations,
            self.tool_side_effects_repeated,
            self.gateway_answered_differently,
        )
        return not any(counts)


def check_run(run_dir: str | Path) -> InvariantReport:
    from streamrl.buffer.cli import load_frame
    from streamrl.streaming.config import StreamRLConfig

    run = RunDir.open(run_dir)
    cfg = StreamRLConfig.model_validate(run.info().config)
    state = DriverState.load(run.driver_state)
    report = InvariantReport(run_dir=str(run_dir), learner_step=state.learner_step, cursor=state.cursor)
    frame = load_frame(run.buffer)
    latest = frame[frame["is_latest"]]
    _check_prompts(report, cfg, state, latest)
    _check_consumption(report, cfg, state, latest)
    _check_accounting(report, run)
    _check_versions(report, state, latest)
    _check_tool_effects(report, run.tool_ledger, latest)
    _check_answers(report, run.answer_ledger)
    return report


def _check_prompts(report: InvariantReport, cfg: StreamRLConfig, state: DriverState, latest: pd.DataFrame) -> None:
    """I1: the groups are exactly the first `cursor` prompts (but the prompt filter's skips, counted
    with the cursor), each with group_size trajectories."""
    from streamrl.streaming.prompt_filter import unexplained_skips
    from streamrl.streaming.prompts import first_group_ids

    expected = set(first_group_ids(cfg.data, state.cursor))
    present = set(latest["group_id"])
    lost, extra = sorted(expected - present), sorted(present - expected)
    if cfg.data.prompt_filter.enabled:
        skipped = state.num_prompts_skipped_easy + state.num_prompts_skipped_hard
        lost = unexplained_skips(
            lost, present, num_skipped=skipped, min_appearances=cfg.data.prompt_filter.min_appearances
        )
    sizes = latest.groupby("group_id")["trajectory_id"].nunique()
    oversized = sorted(sizes[sizes > cfg.buffer.group_size].index)
    report.prompts_lost, report.prompts_duplicated = len(lost), len(extra) + len(oversized)
    report.problems += [f"prompt lost: {g}" for g in lost] + [f"group beyond the cursor: {g}" for g in extra]
    report.problems += [f"group with more than group_size trajectories: {g}" for g in oversized]


def _check_consumption(report: InvariantReport, cfg: StreamRLConfig, state: DriverState, latest: pd.DataFrame) -> None:
    """Exactly-once consumption, one full batch per learner step: `groups_per_batch` whole groups,
    every finished member of each (a member that failed is not trained; the group trains with the rest)."""
    consumed = latest[latest["num_consumed"] > 0]
    twice = consumed[consumed["num_consumed"] > cfg.buffer.reuse]
    report.consumed_twice = len(twice)
    report.problems += [f"consumed {n} times: {t}" for t, n in zip(twice["trajectory_id"], twice["num_consumed"])]
    if cfg.buffer.max_batch_tokens is not None or cfg.buffer.reuse != 1:
        return  # batches of varying size: no count to hold them to
    groups_per_step = consumed.groupby("last_consume_step")["group_id"].nunique()
    steps = set(range(1, state.learner_step + 1))
    bad = [s for s in steps if groups_per_step.get(s, 0) != cfg.buffer.groups_per_batch]
    bad += [s for s in groups_per_step.index if s not in steps]
    report.problems += [f"learner step {s} consumed {groups_per_step.get(s, 0)} groups" for s in bad]
    finished = latest[(latest["status"] == "finished") & latest["group_id"].isin(set(consumed["group_id"]))]
    left = finished[finished["num_consumed"] == 0]
    bad += list(left["trajectory_id"])
    report.problems += [f"finished member of a trained group never trained: {t}" for t in left["trajectory_id"]]
    report.bad_batches = len(bad)


def _check_accounting(report: InvariantReport, run: RunDir) -> None:
    """I2: what the end-of-run accounting saw (absent when the last segment was killed)."""
    acc = run.accounting_record()
    if acc is not None:
        report.stranded, report.untracked = len(acc["stranded"]), len(acc["untracked"])
        report.problems += [f"stranded: {t}" for t in acc["stranded"]] + [f"untracked: {t}" for t in acc["untracked"]]


def _check_versions(report: InvariantReport, state: DriverState, latest: pd.DataFrame) -> None:
    """I4: versions never decrease inside a trajectory and never exceed the saved high-water mark."""
    high = max(state.version_high_water, state.policy_version)
    for tid, versions, mask in zip(latest["trajectory_id"], latest["policy_versions"], latest["response_mask"]):
        sampled = [int(v) for v, m in zip(versions, mask) if m]
        # a sampled token below 0 came from weights no sync published (an engine still joining, elastic.py)
        if sampled != sorted(sampled) or (sampled and (sampled[-1] > high or sampled[0] < 0)):
            report.version_violations += 1
            report.problems.append(f"versions of {tid}: {sampled[:8]}... (high-water {high})")


def _check_tool_effects(report: InvariantReport, ledger: Path, latest: pd.DataFrame) -> None:
    """I5: each tool call's side effect at most once, across pauses, worker deaths and job restarts."""
    if not ledger.exists():
        return
    from collections import Counter

    from streamrl.workloads.tools.ledger import read_ledger

    lines = read_ledger(ledger)
    report.tool_calls_executed = len(lines)
    per_call = Counter((x["instance_id"], x["call_id"]) for x in lines)
    repeated = sorted(k for k, n in per_call.items() if n > 1)
    per_traj = Counter(x["instance_id"] for x in lines)
    finished = latest[latest["status"] == "finished"]
    over = [
        (t, per_traj[t], int(n))
        for t, n in zip(finished["trajectory_id"], finished["num_tool_calls"])
        if per_traj[t] > n and not any(k[0] == t for k in repeated)
    ]
    report.tool_side_effects_repeated = len(repeated) + len(over)
    report.problems += [f"tool call ran {per_call[k]} times: {k[0]} {k[1]}" for k in repeated]
    report.problems += [f"{t}: {n} ledger lines for {c} tool calls" for t, n, c in over]


def _check_answers(report: InvariantReport, ledger: Path) -> None:
    """Exactly-once answers: every answer a gateway client was given for one call is the same."""
    if not ledger.exists():
        return
    from streamrl.workloads.answer_ledger import answer_report, read_answers

    counts = answer_report(read_answers(ledger))
    report.problems += counts.pop("problems")
    report.gateway_answers = counts
    report.gateway_answered_differently = max(
        counts["answered_differently"], counts["answered_differently_across_attempts"]
    )


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    report = check_run(args[0])
    print(json.dumps(asdict(report), indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
