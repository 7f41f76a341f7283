"""`streamrl trace RUN_DIR [--window A:B] [--out FILE] [--json]`: merge a run's lifecycle trace
shards into one Chrome trace-event file (RUN_DIR/trace.json by default; open it in ui.perfetto.dev)
and print where the time went (`observability.trace_summary`). The trace is streamed: the merge and
the summary hold what they count, never the events (`observability.tracing`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from streamrl.core.run_dir import RunDir


def trace_main(args: argparse.Namespace) -> int:
    from streamrl.observability.trace_summary import TraceTotals, format_summary, longest_lives, summary_of
    from streamrl.observability.tracing import open_trace, parse_window, write_chrome

    run_dir = RunDir(args.run_dir)
    if not any(run_dir.trace.glob("*.jsonl")):
        raise ValueError(
            f"{run_dir.root} has no lifecycle trace ({run_dir.trace.name}/*.jsonl): train with trace.enabled=true"
        )
    trace = open_trace(run_dir.root).windowed(parse_window(args.window))
    totals = TraceTotals()

    def counted() -> Iterator[dict[str, Any]]:  # the summary's first pass rides on the merge's
        for event in trace:
            totals.add(event)
            yield event

    path = write_chrome(counted(), Path(args.out) if args.out else run_dir.trace_json)
    summary = summary_of(totals, longest_lives(trace, totals, args.longest), trace)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    shards = len(trace.shards)
    print(f"wrote {path} ({summary['num_events']} events from {shards} shard segments; open it in ui.perfetto.dev)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `trace` to the `streamrl` subcommands."""
    p = sub.add_parser("trace", help="merge RUN_DIR/trace/ into a Chrome/Perfetto trace.json and summarise it")
    p.add_argument("run_dir")
    p.add_argument("--window", metavar="A:B", help="seconds from the trace's start, e.g. 30:90 (either side open)")
    p.add_argument("--out", metavar="FILE", help="the merged trace (default: RUN_DIR/trace.json)")
    p.add_argument("--longest", type=int, default=5, help="how many of the longest trajectories to list")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=trace_main)
