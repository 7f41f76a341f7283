"""The crash matrix (`bench/crash_matrix.py`) and the length comparison of crashed and uncrashed runs
(`bench/crash_lengths.py`), on hand-written results files and samples: which crash kinds a chaos run
had, that a cell sums only the runs that measured it and says "not measured" otherwise, and the
Kolmogorov-Smirnov statistic against hand-computed values."""

from __future__ import annotations

import json

import pytest

from bench import crash_lengths, crash_matrix


def test_the_kinds_of_a_run_come_from_the_faults_that_fired():
    fired = {"gateway.before_answer kill_job": 1, "gateway.before_journal kill_self": 3, "worker.sink raise": 2}
    assert crash_matrix.kill_kinds({"fault_counts": fired, "faults_injected": 6}) == {"job", "worker"}
    assert crash_matrix.kill_kinds({"fault_counts": {"engine.generate kill_self": 1}, "faults_injected": 1}) == {
        "engine"
    }
    # the runner's own SIGKILLs are not in the fault ledger: more faults than fired points
    assert crash_matrix.kill_kinds({"fault_counts": {}, "faults_injected": 2}) == {"job"}
    # older records: the points armed in each segment
    segments = [{"faults": "sigkill_after=40"}, {"faults": "worker.sink=raise%4,worker.after_sink=kill_self@3"}]
    assert crash_matrix.kill_kinds({"segments": segments, "faults_injected": 5}) == {"job", "worker"}
    assert crash_matrix.kill_kinds({"segments": [{"faults": "sync.pause=raise@3"}], "faults_injected": 1}) == set()


def _inv(**counts) -> dict:
    return {"prompts_lost": 0, "prompts_duplicated": 0, "tool_calls_executed": None, "gateway_answers": None} | counts


def test_cells_sum_the_runs_that_measured_them_and_name_what_none_did(tmp_path):
    runs = [
        {"name": "tools", "seed": 0, "fault_counts": {"tool.after_run kill_job": 1}, "faults_injected": 1,
         "completed": True, "invariants": _inv(tool_calls_executed=12, tool_side_effects_repeated=1)},
        {"name": "admission", "seed": 0, "fault_counts": {"admit.after_append kill_job": 1}, "faults_injected": 1,
         "completed": True, "invariants": _inv(prompts_lost=2)},
    ]  # fmt: skip
    families = [
        {"results": [{"name": "io", "completed": True, "invariants": _inv()}, {"name": "hostile", "invariants": {}}]}
    ]
    (tmp_path / "chaos.json").write_text(json.dumps({"results": runs, "fault_families": families}))
    (tmp_path / "crash_consistency.json").write_text(json.dumps({"num_states_checked": 50, "num_problems": 0}))
    matrix = crash_matrix.build(tmp_path)["matrix"]
    job = matrix["job"]
    assert job["prompts_skipped_or_repeated"] == {"value": 2, "runs": 2}
    assert job["tool_effects_repeated"] == {"value": 1, "runs": 1}  # only the run with a tool ledger
    assert job["gateway_answers_changed"]["value"] is None and job["gateway_answers_changed"]["runs"] == 0
    assert job["tokens_lost_per_crash"]["value"] is None  # no progress_loss.json here
    assert matrix["disk_error"]["prompts_skipped_or_repeated"] == {"value": 0, "runs": 1}
    assert matrix["engine"]["runs"] == [] and matrix["engine"]["prompts_skipped_or_repeated"]["value"] is None
    assert matrix["power_loss"]["prompts_skipped_or_repeated"]["states_checked"] == 50
    table = crash_matrix.markdown(matrix)
    assert "| job | 2 (2 runs) | not measured | 1 (1 run) | not measured |" in table
    assert "| power loss | 0 (50 states) |" in table


def test_the_tokens_lost_cell_reads_the_progress_bench():
    progress = {
        "command": "python -m bench.progress_loss",
        "model": "smollm2",
        "trials": [{}, {}],
        "summary": {"off": {"tokens_lost_mean": 2668.5, "tokens_lost_per_trajectory": 166.8}},
    }
    cell = crash_matrix.tokens_lost_cell("worker", {"worker": progress})
    assert cell["value"] == {"off": 2668.5} and cell["runs"] == 2
    assert crash_matrix.tokens_lost_cell("job", {"worker": progress})["value"] == {"off": 2668.5}
    assert crash_matrix.tokens_lost_cell("engine", {"worker": progress})["value"] is None  # not an engine's
    every = {"10s": {**progress["summary"]["off"], "tokens_lost_mean": 40.0}}
    engine = crash_matrix.tokens_lost_cell("engine", {"engine": {**progress, "summary": every}})
    assert engine["value"] == {"10s": 40.0} and "progress_loss_engine.json" in engine["source"]
    preempt = {**progress, "summary": every}
    drained = crash_matrix.tokens_lost_cell("preemption", {"engine": progress, "preempt": preempt})
    assert drained["value"] == {"10s": 40.0} and "progress_loss_preempt.json" in drained["source"]
    assert crash_matrix.tokens_lost_cell("server_engine", {"worker": progress, "engine": progress})["value"] is None
    assert crash_matrix.cell_text(cell) == "2,668 (off)"


def test_ks_statistic_and_quantiles_by_hand():
    assert crash_lengths.ks_statistic([1, 2, 3], [1, 2, 3]) == 0.0
    assert crash_lengths.ks_statistic([1, 2, 3], [4, 5, 6]) == 1.0
    # F_a - F_b at 2: 2/4 - 0/4; at 4: 4/4 - 2/4
    assert crash_lengths.ks_statistic([1, 2, 3, 4], [3, 4, 5, 6]) == 0.5
    assert crash_lengths.ks_statistic([1, 1, 1, 2], [1, 2, 2, 2]) == 0.5  # ties step together
    assert crash_lengths.ks_pvalue(0.0, 100, 100) == 1.0
    assert crash_lengths.ks_pvalue(0.2, 300, 300) < 1e-4 < crash_lengths.ks_pvalue(0.1, 300, 300) < 0.2
    assert crash_lengths.quantile([1, 2, 3, 4], 0.5) == 2.5 and crash_lengths.quantile([5], 0.9) == 5
    with pytest.raises(ValueError):
        crash_lengths.ks_statistic([], [1])
    out = crash_lengths.compare([10, 20, 30, 40], [10, 20, 30, 40])
    assert out["ks_statistic"] == 0.0 and out["mean_clean"] == out["mean_crashed"] == 25.0


def test_a_family_re_run_of_the_same_seed_supersedes_the_older_result():
    from bench.chaos_families import by_kind, supersede

    old = {"name": "hostile", "seed": 0, "hostile_callbacks": 5, "invariants": {"untracked": 4}}
    other = {"name": "hostile", "seed": 1, "hostile_callbacks": 6, "invariants": {}}
    new = {"name": "hostile", "seed": 0, "hostile_callbacks": 7, "invariants": {"untracked": 0}}
    entries = [{"results": [old, other]}, {"results": [new]}]
    supersede(entries)
    assert old["superseded_by"] == 1 and "superseded_by" not in other and "superseded_by" not in new
    kinds = by_kind({"fault_families": entries}, None, {})
    assert kinds["losses_and_violations"]["stranded"] == 0 and kinds["losses_and_violations_from"] == []
    assert kinds["hostile_callbacks"] == 6 + 7  # the older seed-0 run no longer counts
