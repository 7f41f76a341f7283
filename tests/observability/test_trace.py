"""The lifecycle tracer (core.trace), the merge into a Chrome trace (observability.tracing) and its
summary (observability.trace_summary), on events written for real by the tracer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from streamrl.core import trace
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.observability.trace_summary import format_summary, summarize, trajectory_lives
from streamrl.observability.tracing import parse_window, read_trace, to_chrome, windowed


@pytest.fixture(autouse=True)
def _fresh_tracer(monkeypatch):
    """Every test starts with this process's tracer unresolved, and leaves it so."""
    monkeypatch.delenv(trace.RUN_DIR_ENV, raising=False)
    monkeypatch.setattr(trace, "_shard", trace._UNSET)


def _lines(run_dir: Path, *, counters: bool = False) -> list[dict]:
    """The events of every shard (without the tracer's cost counters unless `counters`)."""
    events = [
        json.loads(line) for f in sorted((run_dir / "trace").glob("*.jsonl")) for line in f.read_text().splitlines()
    ]
    return [e for e in events if counters or e["pid"] != trace.TRACER]


def test_off_by_default_writes_nothing(tmp_path):
    with trace.span("stage", "sync", "sync", policy_version=1) as s:
        s.set(bytes=3)
    trace.instant("admitted", "trajectory", "t0")
    trace.complete("busy", "engine", "engine-0", 1.0)
    assert not trace.enabled()
    assert not (tmp_path / "trace").exists()


def test_span_instant_complete_are_chrome_events(tmp_path):
    trace.configure(tmp_path)
    with trace.span("stage", "sync", "sync", policy_version=2) as s:
        s.set(bytes=10)
    with pytest.raises(RuntimeError), trace.span("commit", "sync", "sync"):
        raise RuntimeError("engine lost")
    trace.instant("trained", "trajectory", "t0", learner_step=3)
    trace.complete("busy", "engine", "engine-0", 100.0, 100.5, requests=2)
    stage, commit, trained, busy = _lines(tmp_path)
    assert stage["ph"] == "X" and stage["pid"] == "sync" and stage["args"] == {"policy_version": 2, "bytes": 10}
    assert commit["args"] == {"error": "RuntimeError"}
    assert trained["ph"] == "i" and trained["tid"] == "t0" and trained["args"] == {"learner_step": 3}
    assert (busy["ts"], busy["dur"]) == (100_000_000, 500_000)


def test_threads_never_interleave_lines(tmp_path):
    trace.configure(tmp_path)

    def emit(k: int) -> None:
        for i in range(500):
            trace.instant("appended", "trajectory", f"t{k}", i=i, pad="x" * 200)

    threads = [threading.Thread(target=emit, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = _lines(tmp_path)  # every line parses
    assert len(events) == 2000
    counted = [e["args"]["events"] for e in _lines(tmp_path, counters=True) if e["pid"] == trace.TRACER]
    assert counted == sorted(counted) and counted[-1] <= 2000 and 2000 - counted[-1] < trace.COST_EVERY


def test_the_tracer_counts_its_own_cost(tmp_path, monkeypatch):
    """Every COST_EVERY events and at close a counter with the running totals, stamped no later than
    the last event; the summary divides the cost by the process's traced time."""
    monkeypatch.setattr(trace, "COST_EVERY", 100)
    trace.configure(tmp_path)
    for i in range(250):
        trace.complete("generate", "trajectory", f"t{i}", 1000.0 + i, 1000.5 + i, engine="engine-0")
    trace.configure(None)  # closes the shard: a last counter
    events = _lines(tmp_path, counters=True)
    counters = [e for e in events if e["pid"] == trace.TRACER]
    assert [c["args"]["events"] for c in counters] == [100, 200, 250]
    assert all(c["ph"] == "C" and c["args"]["since_us"] == 1_000_000_000 for c in counters)
    assert counters[-1]["ts"] == max(e["ts"] + e.get("dur", 0) for e in events if e["pid"] != trace.TRACER)
    costs = [c["args"]["cost_us"] for c in counters]
    assert costs == sorted(costs) and costs[-1] > 0
    tracer = summarize(read_trace(tmp_path))["tracer"]
    assert tracer["events"] == 250 and tracer["cost_s"] == pytest.approx(costs[-1] / 1e6)
    share = costs[-1] / 1e6 / 249.5  # the shard's events span 1000.0 .. 1249.5 s
    assert tracer["max_process_share"] == pytest.approx(share)
    assert "tracer cost" in format_summary(summarize(read_trace(tmp_path)))


def test_actor_process_follows_the_runs_config(tmp_path, monkeypatch):
    """An actor finds its run from the environment and traces iff the run's config says so."""
    monkeypatch.setenv(trace.RUN_DIR_ENV, str(tmp_path))

    def run_info(enabled: bool) -> None:
        config = {"trace": {"enabled": enabled}}
        RunDir(tmp_path).write_info(RunInfo(run_name="r", model_path="tiny", mode="async", config=config))

    run_info(False)
    assert not trace.enabled()
    monkeypatch.setattr(trace, "_shard", trace._UNSET)
    run_info(True)
    trace.instant("sampled", "trajectory", "t1", learner_step=1)
    assert [e["name"] for e in _lines(tmp_path)] == ["sampled"]


def test_a_killed_process_keeps_every_event_it_recorded(tmp_path):
    """Line-buffered shards: SIGKILL right after the last event loses none of them."""
    code = (
        "import os, signal, sys\n"
        "from streamrl.core import trace\n"
        "trace.configure(sys.argv[1])\n"
        "for i in range(300): trace.instant('appended', 'trajectory', 't', i=i)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=dict(os.environ), check=False)
    assert proc.returncode == -signal.SIGKILL
    assert [e["args"]["i"] for e in _lines(tmp_path)] == list(range(300))
    # a counter, if one was due, counts only events already written
    assert all(c["args"]["events"] <= 300 for c in _lines(tmp_path, counters=True) if c["pid"] == trace.TRACER)


def _lifecycle(run_dir: Path) -> None:
    """One trajectory generated, parked across a sync, resumed and trained; with engine, learner, sync."""
    shard = run_dir / "trace" / "node-1.jsonl"
    shard.parent.mkdir(parents=True)
    s = 1_000_000  # one second in us
    t0 = 1_700_000_000 * s

    def x(name, pid, tid, start, end, **args):
        return {
            "ph": "X",
            "name": name,
            "pid": pid,
            "tid": tid,
            "ts": t0 + start * s,
            "dur": (end - start) * s,
            "args": args,
        }

    def i(name, tid, at, **args):
        return {"ph": "i", "s": "t", "name": name, "pid": "trajectory", "tid": tid, "ts": t0 + at * s, "args": args}

    events = [
        i("admitted", "t0", 0),
        x("queued", "trajectory", "t0", 0, 1),
        x("generate", "trajectory", "t0", 1, 3, engine="engine-0", min_version=0, max_version=0, aborted=True),
        x("parked", "trajectory", "t0", 3, 5),
        i("resumed", "t0", 5),
        x("generate", "trajectory", "t0", 5, 6, engine="engine-0", min_version=1, max_version=1, aborted=False),
        i("appended", "t0", 6, status="finished", min_version=0, max_version=1),
        i("sampled", "t0", 7, learner_step=2),
        i("trained", "t0", 9, learner_step=2),
        x("generate", "trajectory", "t1", 1, 2, engine="engine-0", min_version=-1, max_version=-1),
        x("busy", "engine", "engine-0", 1, 3),
        x("busy", "engine", "engine-0", 5, 6),
        x("sync", "sync", "sync", 2, 6, policy_version=1),
        x("paused", "sync", "sync", 3, 5, policy_version=1),
        x("train_step", "learner", "learner", 7, 9, learner_step=2),
    ]
    shard.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"ph": "X", "na')  # a torn last line


def test_summary_follows_one_trajectory_across_a_sync(tmp_path):
    _lifecycle(tmp_path)
    tr = read_trace(tmp_path)
    assert tr.num_torn == 1 and len(tr.events) == 15
    life = trajectory_lives(tr)["t0"]
    assert life.events[:6] == ["admitted", "queued", "generate", "parked", "resumed", "generate"]
    assert life.trained_step == 2 and life.versions == {0, 1} and life.seconds == 9
    assert life.phases == {"queued": 1, "generate": 3, "parked": 2}
    s = summarize(tr)
    assert s["window_s"] == 9
    assert s["engine_busy"] == {"engine-0": pytest.approx(3 / 9)}
    assert s["learner_busy"] == pytest.approx(2 / 9)
    assert s["sync_pause_share"] == pytest.approx(2 / 9)
    assert s["trajectories"] == {"traced": 2, "trained": 1, "parked": 1, "resumed": 1}
    assert s["longest"][0]["trajectory_id"] == "t0"
    assert s["longest"][0]["path"].startswith("admitted > queued > generate > parked > resumed > generate > appended")
    assert trajectory_lives(tr)["t1"].versions == set()  # -1: no token sampled
    text = format_summary(s)
    assert "trained at step 2" in text and "sync pause share: 22.2%" in text


def test_chrome_export_names_rows_and_windows_clip(tmp_path):
    _lifecycle(tmp_path)
    tr = read_trace(tmp_path)
    chrome = to_chrome(tr)
    meta = [e for e in chrome["traceEvents"] if e["ph"] == "M"]
    names = {e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {"trajectory", "engine", "sync", "learner"}
    body = [e for e in chrome["traceEvents"] if e["ph"] != "M"]
    assert len(body) == 15 and all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in body)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {threads[(e["pid"], e["tid"])] for e in body if e["name"] == "busy"} == {"engine-0"}
    cut = windowed(tr, parse_window("4:8"))
    sync = next(e for e in cut.events if e["name"] == "sync")
    assert sync["ts"] == tr.start_us + 4_000_000 and sync["dur"] == 2_000_000  # clipped to [4, 6]
    assert "admitted" not in {e["name"] for e in cut.events}
    with pytest.raises(ValueError):
        parse_window("8:4")


def test_trace_cli_merges_and_summarises(tmp_path, capsys):
    from streamrl.streaming.cli import main

    _lifecycle(tmp_path)
    assert main(["trace", str(tmp_path), "--json"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[: printed.rindex("}") + 1])
    assert summary["trajectories"]["trained"] == 1
    merged = json.loads((tmp_path / "trace.json").read_text())
    assert len([e for e in merged["traceEvents"] if e["ph"] != "M"]) == 15
    assert main(["trace", str(tmp_path / "none")]) == 2  # no trace there: one clear error


@pytest.mark.parametrize(
    "bad",
    [{"ts": "soon"}, {"ts": None}, {"ts": True}, {"ts": float("nan")}, {"dur": "long"}, {"args": [1]}, {"name": None}],
)
def test_a_malformed_event_is_skipped_and_counted_not_fatal(tmp_path, capsys, bad):
    """One event whose `ts` is not a number aborted `streamrl trace` (sorting str against int)."""
    from streamrl.streaming.cli import main

    _lifecycle(tmp_path)
    event = {"ph": "X", "name": "busy", "pid": "engine", "tid": "engine-0", "ts": 1, "dur": 1, "args": {}}
    event = {k: v for k, v in {**event, **bad}.items() if v is not None}
    with (tmp_path / "trace" / "extra.jsonl").open("w") as f:
        f.write(json.dumps(event) + "\n")
    tr = read_trace(tmp_path)
    assert tr.num_torn == 2 and len(tr.events) == 15  # the torn line of `_lifecycle`, and this one
    assert main(["trace", str(tmp_path)]) == 0
    assert "2 torn or malformed lines skipped" in capsys.readouterr().out


def test_report_section_only_for_traced_runs(tmp_path):
    from streamrl.observability.report_timeline import timeline_blocks, window_of

    problems: list[str] = []
    assert timeline_blocks(tmp_path, problems) == []  # untraced: the page is unchanged
    _lifecycle(tmp_path)
    assert window_of(read_trace(tmp_path)) == (7.0, 127.0)  # from the first learner step
    (block,) = timeline_blocks(tmp_path, problems)
    assert problems == [] and block.anchor == "lifecycle"
    assert "<svg" in str(block.svg) and "learner (train_step)" in str(block.svg)
    assert "learner busy 100%" in block.caption  # the window's only span time is the step at 7..9
