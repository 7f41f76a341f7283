"""`streamrl trace RUN_DIR [--window A:B] [--out FILE] [--json]`: merge a run's lifecycle trace
shards into one Chrome trace-event file (RUN_DIR/trace.json by default; open it in ui.perfetto.dev)
and print where the time went (`observability.trace_summary`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from streamrl.core.run_dir import RunDir


def trace_main(args: argparse.Namespace) -> int:
    from streamrl.observability.trace_summary import format_summary, summarize
    from streamrl.observability.tracing import parse_window, read_trace, windowed, write_chrome

    run_dir = RunDir(args.run_dir)
    if not any(run_dir.trace.glob("*.jsonl")):
        raise ValueError(
            f"{run_dir.root} has no lifecycle trace ({run_dir.trace.name}/*.jsonl): train with trace.enabled=true"
        )
    trace = windowed(read_trace(run_dir.root), parse_window(args.window))
    path = write_chrome(trace, Path(args.out) if args.out else run_dir.trace_json)
    summary = summarize(trace, longest=args.longest)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    print(f"wrote {path} ({len(trace.events)} events from {len(trace.shards)} shards; open it in ui.perfetto.dev)")
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
