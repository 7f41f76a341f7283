"""The fast subset of the chaos suite (`make chaos` runs all of it, seeded, into bench/results):
one real run with repeated faults — a sink that raises every few rows, every rollout-worker
incarnation killed after its k-th saved row, then the whole job SIGKILLed mid-admission — resumed
until it finishes and checked against the invariants from the durable log and run directory only."""

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
