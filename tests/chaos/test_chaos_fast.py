"""The fast subset of the chaos suite (`make chaos` runs all of it, seeded, into bench/results): one
real run with repeated faults, resumed until it finishes and checked against the invariants from the
durable log and run directory only. A tool-calling tiny model whose calculator appends a ledger line
per execution: the job SIGKILLed right after a tool ran (its result lost with it), then, in the
resumed job, a sink that raises every few rows and every rollout-worker incarnation killed right
after its 3rd tool execution. No prompt lost or duplicated, nothing consumed twice or stranded, and
no (trajectory, call id) run twice (I1, I2, I5)."""

from __future__ import annotations

import pytest

from bench.chaos import run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.timeout(1500)
def test_job_and_worker_kills_and_sink_errors_keep_every_invariant(tmp_path, tiny_model_path):
    faulted = ["tool.after_run=kill_job@2", "worker.sink=raise%3,tool.after_run=kill_self@3"]
    result = run_scenario("tools", 0, faulted, tmp_path, timeout_s=600)
    assert result.hangs == 0, result.segments
    assert result.completed and result.skipped == [], result.segments
    assert result.segments[0]["rc"] not in (0, None), result.segments  # the job kill did land
    fired = result.fault_counts
    assert fired.get("tool.after_run kill_job") == 1, fired
    assert fired.get("worker.sink raise", 0) >= 1 and fired.get("tool.after_run kill_self", 0) >= 1, fired
    inv = result.invariants
    assert inv["problems"] == [], inv["problems"][:10]
    assert inv["tool_calls_executed"] >= 4 and inv["tool_side_effects_repeated"] == 0
    assert inv["learner_step"] == 3 and inv["stranded"] == 0 and inv["untracked"] == 0
