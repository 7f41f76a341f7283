"""The report's lifecycle-trace section: a timeline picture of one window of a traced run (engines
busy, learner steps, weight syncs, and the longest trajectories phase by phase), drawn from the
run's trace (`observability.tracing`). A run without a trace gets no section: its page is unchanged.

The window starts at the first learner step (engine start-up is the same in every run and says
nothing) and lasts at most `WINDOW_S`; the longest trajectories are those with the most time inside it.
The trace is streamed (the end-of-run report must not take the memory of a long run's whole trace):
a pass finds the window, one adds up the window's totals, and one collects the rows' spans.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.core.run_dir import RunDir
from streamrl.observability.report_figures import FigureBlock, to_svg
from streamrl.observability.trace_summary import TRAJECTORY, TrajectoryLife, summary_of, trace_totals, trajectory_lives
from streamrl.observability.tracing import Events, TraceStream, open_trace

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

WINDOW_S = 120.0
NUM_TRAJECTORIES = 12
PHASE_COLORS = {
    "queued": "#d9d9d9",
    "generate": "#1f77b4",
    "tool": "#ff7f0e",
    "interaction": "#9467bd",
    "parked": "#d62728",
}
PART_ROWS = (("engine", "busy", "#1f77b4"), ("learner", "train_step", "#2ca02c"), ("sync", "paused", "#8c564b"))


Bars = list[tuple[float, float, str]]  # (start s from the window's start, length s, colour)


def window_of(trace: Events) -> tuple[float, float]:
    """Seconds from the trace's start: the first learner step, then at most `WINDOW_S` (one pass)."""
    start, first_step = None, None
    for e in trace:
        start = e["ts"] if start is None else min(start, e["ts"])
        if e["pid"] == "learner" and e["name"] == "train_step":
            first_step = e["ts"] if first_step is None else min(first_step, e["ts"])
    lo = (first_step - start) / 1e6 if first_step is not None and start is not None else 0.0
    return lo, lo + WINDOW_S


def _rows(trace: Events, origin_us: int, longest: list[str]) -> tuple[list[tuple[str, Bars]], list[TrajectoryLife]]:
    """One pass: (label, bars) per row, top to bottom (engines busy, learner steps, syncs paused, then
    the `longest` trajectories phase by phase), and those trajectories' lives."""
    tracks: dict[tuple[str, str], Bars] = {}
    colours = {(kind, name): colour for kind, name, colour in PART_ROWS}
    ids, theirs = set(longest), []
    for e in trace:
        colour = colours.get((e["pid"], e["name"]))
        if colour is not None and e.get("ph") == "X":
            bar = ((e["ts"] - origin_us) / 1e6, e["dur"] / 1e6, colour)
            tracks.setdefault((e["pid"], str(e["tid"])), []).append(bar)
        elif e["pid"] == TRAJECTORY and str(e["tid"]) in ids:
            theirs.append(e)
    rows: list[tuple[str, Bars]] = []
    for kind, name, _ in PART_ROWS:
        rows += [(f"{track} ({name})", bars) for (k, track), bars in sorted(tracks.items()) if k == kind]
    found = trajectory_lives(theirs)
    lives = [found[tid] for tid in longest if tid in found]
    for life in lives:
        bars = [
            ((ts - origin_us) / 1e6, d / 1e6, PHASE_COLORS[name]) for name, ts, d in life.spans if name in PHASE_COLORS
        ]
        step = f" → step {life.trained_step}" if life.trained_step is not None else ""
        rows.append((f"{life.trajectory_id}{step}", bars))
    return rows, lives


def plot_trace_timeline(rows: list[tuple[str, Bars]]) -> Figure | None:
    """The window's timeline from its rows (label, bars) top to bottom, or None when nothing in it
    has a duration."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = [(label, bars) for label, bars in rows if bars]
    if not rows:
        return None
    fig = Figure(figsize=(12.0, 0.9 + 0.28 * len(rows)), layout="constrained")
    ax: Axes = fig.subplots()
    for y, (_, bars) in enumerate(rows):
        ax.broken_barh([(s, max(d, 1e-3)) for s, d, _ in bars], (y - 0.4, 0.8), facecolors=[c for *_, c in bars])
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds in the window")
    handles = [Patch(color=c, label=n) for n, c in PHASE_COLORS.items()]
    handles += [Patch(color=c, label=f"{k} {n}") for k, n, c in PART_ROWS[1:]]
    ax.legend(
        handles=handles, fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=len(handles), frameon=False
    )
    return fig


def _caption(summary: dict[str, Any], window: tuple[float, float]) -> str:
    busy = ", ".join(f"{k} {v:.0%}" for k, v in summary["engine_busy"].items()) or "-"
    dropped = summary["dropped"]
    gone = (
        f"The trace no longer holds its oldest {dropped['events']} events (trace.max_total_mb). "
        if dropped["segments"]
        else ""
    )
    return (
        gone
        + f"Window {window[0]:.0f}–{window[0] + summary['window_s']:.0f} s of the trace (from the first learner step). "
        f"Engine busy {busy}; learner busy {summary['learner_busy']:.0%}; syncs held generation paused "
        f"{summary['sync_pause_share']:.1%} of the window. Rows below the parts: the {NUM_TRAJECTORIES} longest "
        "trajectories in the window: queued, generating, running tools, waiting for the environment, parked. "
        "`streamrl trace RUN_DIR` "
        "merges the whole trace into RUN_DIR/trace.json for Perfetto."
    )


def timeline_blocks(run_dir: str | Path, problems: list[str]) -> list[FigureBlock]:
    """The report section of a traced run ([] for a run without a trace). A failure becomes a note."""
    if not any(RunDir(run_dir).trace.glob("*.jsonl")):
        return []
    block = FigureBlock(anchor="lifecycle", title="Lifecycle trace", empty="the trace has no spans")
    try:
        full: TraceStream = open_trace(run_dir)
        window = window_of(full)
        trace = full.windowed(window)
        totals = trace_totals(trace)
        rows, lives = _rows(trace, totals.start_us, totals.longest(NUM_TRAJECTORIES))
        fig = plot_trace_timeline(rows)
        if fig is not None:
            block.svg, block.caption = to_svg(fig), _caption(summary_of(totals, lives, trace), window)
    except Exception as exc:  # fault boundary: the trace must never lose the report
        logger.warning("report figure lifecycle failed: %s", exc)
        problems.append(f"figure 'Lifecycle trace' failed: {type(exc).__name__}: {exc}")
    return [block]


__all__ = ["plot_trace_timeline", "timeline_blocks", "window_of"]
