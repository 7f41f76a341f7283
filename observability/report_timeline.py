"""The report's lifecycle-trace section: a timeline picture of one window of a traced run (engines
busy, learner steps, weight syncs, and the longest trajectories phase by phase), drawn from the
merged trace (`observability.tracing`). A run without a trace gets no section: its page is unchanged.

The window starts at the first learner step (engine start-up is the same in every run and says
nothing) and lasts at most `WINDOW_S`; the longest trajectories are those with the most time inside it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.core.run_dir import RunDir
from streamrl.observability.report_figures import FigureBlock, to_svg
from streamrl.observability.trace_summary import summarize, trajectory_lives
from streamrl.observability.tracing import Trace, read_trace, windowed

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


def window_of(trace: Trace) -> tuple[float, float]:
    """Seconds from the trace's start: the first learner step, then at most `WINDOW_S`."""
    steps = [e["ts"] for e in trace.events if e["pid"] == "learner" and e["name"] == "train_step"]
    lo = (min(steps) - trace.start_us) / 1e6 if steps else 0.0
    return lo, lo + WINDOW_S


def _rows(trace: Trace) -> list[tuple[str, list[tuple[float, float, str]]]]:
    """(label, [(start s, length s, colour)]) per row, top to bottom, times from the window's start."""
    origin = trace.start_us
    rows: list[tuple[str, list[tuple[float, float, str]]]] = []
    for kind, name, colour in PART_ROWS:
        tracks: dict[str, list[tuple[float, float, str]]] = {}
        for e in trace.events:
            if e["pid"] == kind and e["name"] == name and e.get("ph") == "X":
                tracks.setdefault(str(e["tid"]), []).append(((e["ts"] - origin) / 1e6, e["dur"] / 1e6, colour))
        rows += [(f"{track} ({name})", bars) for track, bars in sorted(tracks.items())]
    lives = trajectory_lives(trace)
    longest = sorted(lives.values(), key=lambda life: life.seconds, reverse=True)[:NUM_TRAJECTORIES]
    for life in longest:
        bars = [
            ((e["ts"] - origin) / 1e6, e["dur"] / 1e6, PHASE_COLORS[e["name"]])
            for e in trace.events
            if e["pid"] == "trajectory" and e["tid"] == life.trajectory_id and e["name"] in PHASE_COLORS
        ]
        step = f" → step {life.trained_step}" if life.trained_step is not None else ""
        rows.append((f"{life.trajectory_id}{step}", bars))
    return rows


def plot_trace_timeline(trace: Trace) -> Figure | None:
    """The window's timeline, or None when nothing in it has a duration."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = [(label, bars) for label, bars in _rows(trace) if bars]
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
    return (
        f"Window {window[0]:.0f}–{window[0] + summary['window_s']:.0f} s of the trace (from the first learner step). "
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
        full = read_trace(run_dir)
        window = window_of(full)
        trace = windowed(full, window)
        fig = plot_trace_timeline(trace)
        if fig is not None:
            block.svg, block.caption = to_svg(fig), _caption(summarize(trace), window)
    except Exception as exc:  # fault boundary: the trace must never lose the report
        logger.warning("report figure lifecycle failed: %s", exc)
        problems.append(f"figure 'Lifecycle trace' failed: {type(exc).__name__}: {exc}")
    return [block]


__all__ = ["plot_trace_timeline", "timeline_blocks", "window_of"]
