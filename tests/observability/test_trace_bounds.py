"""The lifecycle trace stays bounded on disk and in memory: a process's shard rotates to a new
segment past `trace.max_shard_mb`, the oldest closed segments are deleted past `trace.max_total_mb`
(and the drop recorded and reported), and `streamrl trace` and the report read a trace shard by shard,
line by line, so their memory follows the summary, not the trace's size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.trace_overhead import READERS, reader_peak_rss, synthetic_trace
from streamrl.core import trace
from streamrl.core.run_dir import RunDir, RunInfo

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _fresh_tracer(monkeypatch):
    """Every test starts with this process's tracer unresolved, and leaves it so."""
    monkeypatch.delenv(trace.RUN_DIR_ENV, raising=False)
    monkeypatch.setattr(trace, "_shard", trace._UNSET)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> tuple[Path, Path, int]:
    """A small trace (to warm a reader up on) and a 20 MB one, and the big one's size in bytes."""
    small, big = tmp_path_factory.mktemp("small"), tmp_path_factory.mktemp("big")
    synthetic_trace(small, 200_000)
    return small, big, synthetic_trace(big, 20_000_000)


@pytest.mark.parametrize("reader", READERS)
def test_a_reader_holds_the_summary_not_the_trace(traces, reader):
    """`streamrl trace` (merge + summary) and the report's timeline, each in a fresh process: reading
    a 20 MB trace grows its peak RSS far less than the trace's size (read whole, a trace took about
    ten times its size)."""
    small, big, size = traces
    rss = reader_peak_rss(reader, small, big)
    grown_mb = rss["peak_rss_mb"] - rss["baseline_rss_mb"]
    assert grown_mb < size / 1e6 / 4, f"{reader}: peak RSS grew {grown_mb:.1f} MB reading {size / 1e6:.0f} MB ({rss})"


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def test_the_streamed_summary_is_the_in_memory_one(tmp_path):
    """The summary is the same read in file order, shard by shard, as on the whole time-sorted trace."""
    from streamrl.observability.trace_summary import summarize
    from streamrl.observability.tracing import open_trace, read_trace, to_chrome

    synthetic_trace(tmp_path, 1_000_000)
    streamed, whole = summarize(open_trace(tmp_path)), summarize(read_trace(tmp_path))
    assert _rounded(streamed) == _rounded(whole)  # sums in another order: the last bits may differ
    assert streamed["trajectories"]["traced"] == streamed["trajectories"]["trained"] > 300
    assert streamed["longest"][0]["path"].startswith("admitted > queued > generate > tool")
    events = [e for e in to_chrome(open_trace(tmp_path))["traceEvents"] if e["ph"] != "M"]
    assert len(events) == streamed["num_events"]


def test_shards_rotate_and_the_oldest_segments_go_past_the_cap(tmp_path, monkeypatch):
    """An actor's shard (limits from the run's config) rotates past `max_shard_mb`; past
    `max_total_mb` the oldest closed segments are deleted, the newest events all kept, in order, and
    every dropped event counted in the ledger the summary reports."""
    monkeypatch.setattr(trace, "COST_EVERY", 10**9)  # one cost counter, at the close: exact line counts
    monkeypatch.setattr(trace, "COST_EVERY_S", 1e9)
    monkeypatch.setenv(trace.RUN_DIR_ENV, str(tmp_path))
    config = {"trace": {"enabled": True, "max_shard_mb": 0.02, "max_total_mb": 0.1}}
    RunDir(tmp_path).write_info(RunInfo(run_name="r", model_path="tiny", mode="async", config=config))
    num_events = 3000
    for i in range(num_events):  # ~130 bytes a line: ~0.4 MB in all
        trace.instant("appended", "trajectory", f"t{i}", i=i, pad="x" * 40)
    trace.configure(None)  # closes the shard (a last cost counter)

    segments = sorted(RunDir(tmp_path).trace.glob("*.jsonl"))
    sizes = [p.stat().st_size for p in segments]
    line = 200
    assert len(segments) > 1 and max(sizes) <= 20_000 + line, sizes
    assert sum(sizes) <= 100_000 + 20_000 + line, sizes  # the cap, and the open segment

    from streamrl.observability.trace_summary import format_summary, summarize
    from streamrl.observability.tracing import open_trace

    kept = [e["args"]["i"] for e in open_trace(tmp_path) if e["pid"] != trace.TRACER]
    assert kept == list(range(num_events - len(kept), num_events)) and len(kept) < num_events

    summary = summarize(open_trace(tmp_path))
    dropped = summary["dropped"]
    assert dropped["events"] == num_events - len(kept) and dropped["segments"] >= 1
    assert dropped["bytes"] + sum(sizes) >= 3000 * 120
    assert f"{dropped['events']} events" in format_summary(summary)

    trace.configure(tmp_path)  # this process again (its pid, its track): after its segments, never into one
    trace.instant("appended", "trajectory", "again")
    trace.configure(None)
    (newest,) = set(RunDir(tmp_path).trace.glob("*.jsonl")) - set(segments)
    assert [json.loads(line)["tid"] for line in newest.read_text().splitlines()][0] == "again"
    assert [p.stat().st_size for p in sorted(RunDir(tmp_path).trace.glob("*.jsonl")) if p in segments] == sizes
