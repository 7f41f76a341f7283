"""The per-step metrics line, as pure functions of what the driver gathered from the parts.

`Pipeline.log_step` does the I/O (buffer stats, worker counters, engine stats, memory); everything it
derives from them (counter increments, rates, engine busy fractions) is computed here, so it is tested
without actors (`tests/observability/test_catalogue.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from streamrl.core import catalogue
from streamrl.core.catalogue import Reduction

if TYPE_CHECKING:
    from streamrl.engines.base import EngineStats


def sum_metrics(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """Key-wise sum of the rollout workers' metrics (counters and gauges alike)."""
    totals: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def max_metrics(parts: Iterable[dict[str, float]], into: dict[str, float]) -> dict[str, float]:
    """Key-wise maximum (memory peaks of several actors: the fullest one)."""
    out = dict(into)
    for part in parts:
        for key, value in part.items():
            out[key] = max(out.get(key, 0.0), value)
    return out


def worker_increments(totals: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    """Counters (`Reduction.COUNT`) as increments since the last step; other keys as they are. A
    counter that went down (a replaced worker restarts at 0) counts 0, never negative."""
    return {
        key: max(value - last.get(key, 0.0), 0.0) if catalogue.reduction(key) is Reduction.COUNT else value
        for key, value in totals.items()
    }


def rollout_interval_metrics(metrics: dict[str, float], interval_s: float) -> dict[str, float]:
    """Rates and per-trajectory means of the interval since the last log line, from the rollout
    workers' counter increments in `metrics` (a mean of nothing is left out, not logged as 0)."""
    out = {"rollout/tokens_per_s": metrics.get("rollout/num_generated_tokens", 0.0) / max(interval_s, 1e-9)}
    if finished := metrics.get("rollout/num_finished"):  # every trajectory finished, not only the trained batch
        out["rollout/finished_reward_mean"] = metrics.get("rollout/reward_sum", 0.0) / finished
        out["rollout/num_turns_mean"] = metrics.get("rollout/turns_sum", 0.0) / finished
        out["rollout/tool_calls_mean"] = metrics.get("rollout/tool_calls_sum", 0.0) / finished
    if calls := metrics.get("rollout/num_tool_calls"):
        out["rollout/tool_error_rate"] = metrics.get("rollout/num_tool_errors", 0.0) / calls
    if executed := metrics.get("rollout/tools/num_executed"):
        out["rollout/tools/mean_latency_s"] = metrics.get("rollout/tools/latency_sum_s", 0.0) / executed
    if scored := metrics.get("distill/num_scored"):
        out["distill/teacher_latency_mean_s"] = metrics.get("distill/score_s_sum", 0.0) / scored
    if sampled := metrics.get("rollout/gateway/num_sampled"):
        out["rollout/gateway/overhead_mean_ms"] = 1000.0 * metrics.get("rollout/gateway/overhead_sum_s", 0.0) / sampled
    if reported := metrics.get("rollout/program/num_samples"):  # a gateway command's named numbers
        for key, total in metrics.items():
            if key.startswith("rollout/program/") and key.endswith("/sum"):
                out[key.removesuffix("/sum") + "/mean"] = total / reported
    return out


def engine_metrics(stats: Sequence[EngineStats | None]) -> dict[str, float]:
    """Busy fraction per engine (0 for one that did not answer) and the mean over those that did."""
    out = {f"engine/busy_fraction/engine-{i}": s.busy_fraction if s else 0.0 for i, s in enumerate(stats)}
    answered = [s for s in stats if s is not None]
    out["engine/busy_s"] = sum(s.busy_s for s in answered) / max(len(answered), 1)
    out["engine/uptime_s"] = sum(s.uptime_s for s in answered) / max(len(answered), 1)
    out["engine/busy_fraction"] = out["engine/busy_s"] / max(out["engine/uptime_s"], 1e-9)
    return out
