"""The metrics catalogue: unambiguous declarations, no key written or read that is not declared, and
the driver's derived rollout metrics. (That a real run logs exactly the declared keys is checked at
the end of tests/streaming/test_e2e.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamrl.core import catalogue
from streamrl.core.catalogue import PLACEHOLDERS, Reduction
from streamrl.streaming.step_metrics import rollout_interval_metrics

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("streaming", "observability", "rollout", "buffer", "learner", "weight_sync", "sim")
NAMESPACES = "rollout|learner|buffer|staleness|engine|sync|memory|is|length|time|metrics|invariants|data"
# A complete key in a plain string literal (f-strings and prefixes such as "memory/" are not keys).
KEY_LITERAL = re.compile(rf'(?<![fFrRbB\w])"((?:{NAMESPACES})/[\w/.+-]*[a-zA-Z0-9+])"')
SAMPLES = {
    "is_stat": "ratio_p90",
    "bucket": "lag_2plus",
    "lag_scope": "tokens",
    "lag_k": "over",
    "lag_stat": "p99",
    "phase": "over_age",
    "length_kind": "dropped_over_age",
    "tokens": "512",
    "part": "rollout_worker",
    "engine": "engine-3",
    "program_metric": "exit_submitted",
}


def _sample(pattern: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: SAMPLES[m.group(1)], pattern)


def test_every_declaration_matches_its_keys_and_no_other_declaration_does():
    assert set(SAMPLES) == set(PLACEHOLDERS)
    keys = [m.key for m in catalogue.METRICS]
    assert len(keys) == len(set(keys))
    for metric in catalogue.METRICS:
        assert catalogue.matches(_sample(metric.key)) == [metric], metric.key
        assert metric.meaning and metric.unit
    assert catalogue.lookup("is/ratio_mean/lag_0").key == "is/{is_stat}/{bucket}"
    assert catalogue.lookup("memory/learner_gpu_peak_gb").key == "memory/{part}_gpu_peak_gb"
    assert catalogue.lookup("memory/learner_peak_gb").key == "memory/{part}_peak_gb"
    assert catalogue.lookup("buffer/groups_over_token_budget").reduction is Reduction.TOTAL
    for bad in (
        "rollout/nope",
        "is/ratio_mean/lag_x",
        "memory/gpu_peak_gb",
        "staleness/lag_frac/batch/",
        "staleness/lag_hist/0",
    ):
        with pytest.raises(KeyError, match="not declared"):
            catalogue.lookup(bad)
        assert catalogue.reduction(bad) is None


def test_every_key_the_code_names_is_declared():
    """Writers and readers (report, figures, progress line) alike: a key a reader names and no
    declaration covers is a dead panel; one a writer logs undeclared is an unknown metric."""
    named: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for match in KEY_LITERAL.finditer(path.read_text()):
                named.setdefault(match.group(1), []).append(str(path.relative_to(REPO)))
    assert len(named) > 100  # the scan sees the code (a broken pattern would pass vacuously)
    assert {k: v for k, v in named.items() if not catalogue.matches(k)} == {}


def test_reader_keys_come_from_the_catalogue():
    from streamrl.observability import metrics

    assert (metrics.REWARD_KEY, metrics.LAG_KEY, metrics.ENGINE_BUSY_KEY) == (
        catalogue.REWARD,
        catalogue.LAG,
        catalogue.ENGINE_BUSY,
    )
    for key in (
        catalogue.REWARD,
        catalogue.LAG,
        catalogue.ENGINE_BUSY,
        catalogue.ROLLOUT_TOKENS_PER_S,
        catalogue.LEARNER_TOKENS_PER_S,
        catalogue.WANDB_ERRORS,
        *catalogue.RESERVED,
    ):
        catalogue.lookup(key)


def test_counters_are_the_worker_keys_the_driver_turns_into_increments():
    from streamrl.rollout.worker import RolloutWorker  # noqa: F401  (the keys below are what RolloutWorker.metrics writes)

    for key in (
        "rollout/num_finished",
        "rollout/reward_sum",
        "rollout/turns_sum",
        "rollout/num_generated_tokens",
        "rollout/tools/num_calls",
        "rollout/num_engine_failures",
    ):
        assert catalogue.reduction(key) is Reduction.COUNT, key
    for key in ("rollout/num_running", "rollout/num_held", "rollout/num_in_flight"):
        assert catalogue.reduction(key) is Reduction.LAST, key


def test_rollout_interval_metrics():
    increments = {
        "rollout/num_generated_tokens": 300.0,
        "rollout/num_finished": 4.0,
        "rollout/reward_sum": 3.0,
        "rollout/turns_sum": 10.0,
        "rollout/tool_calls_sum": 6.0,
        "rollout/num_tool_calls": 8.0,
        "rollout/num_tool_errors": 2.0,
        "rollout/tools/num_executed": 5.0,
        "rollout/tools/latency_sum_s": 1.0,
    }
    assert rollout_interval_metrics(increments, 10.0) == {
        "rollout/tokens_per_s": 30.0,
        "rollout/finished_reward_mean": 0.75,
        "rollout/num_turns_mean": 2.5,
        "rollout/tool_calls_mean": 1.5,
        "rollout/tool_error_rate": 0.25,
        "rollout/tools/mean_latency_s": 0.2,
    }
    # An interval with nothing finished and no tool call logs a rate of 0, and no mean of nothing.
    assert rollout_interval_metrics({"rollout/num_finished": 0.0, "rollout/num_tool_calls": 0.0}, 5.0) == {
        "rollout/tokens_per_s": 0.0
    }
    for key in rollout_interval_metrics(increments, 1.0):
        catalogue.lookup(key)


def test_worker_increments_and_engine_metrics():
    from streamrl.engines.base import EngineStats
    from streamrl.streaming.step_metrics import engine_metrics, sum_metrics, worker_increments

    totals = sum_metrics([{"rollout/num_finished": 5.0, "rollout/num_running": 2.0}, {"rollout/num_finished": 3.0}])
    assert totals == {"rollout/num_finished": 8.0, "rollout/num_running": 2.0}
    # counters are increments since the last step (never negative after a worker restart); gauges stay
    assert worker_increments(totals, {"rollout/num_finished": 6.0, "rollout/num_running": 9.0}) == {
        "rollout/num_finished": 2.0,
        "rollout/num_running": 2.0,
    }
    assert worker_increments(totals, {"rollout/num_finished": 20.0})["rollout/num_finished"] == 0.0

    def stats(busy: float, up: float) -> EngineStats:
        return EngineStats(
            engine_id="e",
            policy_version=0,
            num_running=0,
            busy_s=busy,
            uptime_s=up,
            num_generated_tokens=0,
            num_prompt_tokens=0,
            num_aborted=0,
        )

    out = engine_metrics([stats(3.0, 10.0), None, stats(1.0, 10.0)])
    assert out["engine/busy_fraction/engine-0"] == 0.3
    assert out["engine/busy_fraction/engine-1"] == 0.0  # did not answer
    assert out["engine/busy_s"] == 2.0 and out["engine/uptime_s"] == 10.0  # the mean over those that answered
    assert out["engine/busy_fraction"] == 0.2
