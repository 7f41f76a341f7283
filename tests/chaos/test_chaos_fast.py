"""The fast subset of the chaos suite (`make chaos` runs all of it, seeded, into bench/results):
real runs with repeated faults, resumed until they finish and checked against the invariants from
the durable log and run directory only. One: a sink that raises every few rows, every rollout-worker
incarnation killed after its k-th saved row, then the whole job SIGKILLed mid-admission. Two: tool
side effects (I5) under job and worker kills right after a tool ran."""

from __future__ import annotations

import pytest

from bench.chaos import run_scenario, scenarios

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.timeout(1500)
def test_worker_faults_keep_every_invariant(tmp_path, tiny_model_path):
    result = run_scenario("workers", 0, scenarios(0)["workers"], tmp_path, timeout_s=600)
    assert result.hangs == 0, result.segments
    assert result.completed, result.segments
    assert result.faults_injected >= 3, result.segments  # sink errors, worker kills, the job kill
    inv = result.invariants
    assert inv["problems"] == [], inv["problems"][:10]
    assert inv["learner_step"] == 3 and inv["stranded"] == 0 and inv["untracked"] == 0


@pytest.mark.timeout(1500)
def test_tool_side_effects_happen_at_most_once_across_kills(tmp_path, tiny_model_path):
    """I5 on the real system: a tool-calling tiny model whose calculator appends a ledger line per
    execution; the job is SIGKILLed right after a tool ran (its result lost), then every rollout-worker
    incarnation is killed right after its 3rd tool execution. No (trajectory, call id) may run twice."""
    faulted = ["tool.after_run=kill_job@2", "tool.after_run=kill_self@3"]
    result = run_scenario("tools", 0, faulted, tmp_path, timeout_s=600)
    assert result.hangs == 0, result.segments
    assert result.completed, result.segments
    assert result.segments[0]["rc"] not in (0, None), result.segments  # the job kill did land
    assert result.faults_injected >= 2, result.segments
    inv = result.invariants
    assert inv["problems"] == [], inv["problems"][:10]
    assert inv["tool_calls_executed"] >= 4 and inv["tool_side_effects_repeated"] == 0
    assert inv["learner_step"] == 3 and inv["stranded"] == 0 and inv["untracked"] == 0
