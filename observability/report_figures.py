"""Figures of the run report (report.py): matplotlib figures rendered to inline SVG.

Every function takes the metrics table (one row per `MetricsLogger.log` record, one column per
metric key, see metrics.py) or the timeline spans and returns a `Figure`, or None when the run
logged nothing it could show. Figures are built with `matplotlib.figure.Figure` directly (no
pyplot state), so rendering is safe anywhere. `build_figures` is the report's fault boundary: a
figure that fails becomes a note on the page, never a lost report.
"""

from __future__ import annotations

import functools
import io
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.core import catalogue
from streamrl.observability.metrics import ENGINE_BUSY_KEY, REWARD_KEY, SpanKind

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

KIND_COLORS = {
    SpanKind.GENERATE: "#1f77b4",
    SpanKind.TOOL: "#ff7f0e",
    SpanKind.TRAIN: "#2ca02c",
    SpanKind.SYNC: "#d62728",
    SpanKind.IDLE: "#d9d9d9",
}
LAG_KEY_RE = re.compile(r"^is/(?P<stat>[^/]+)/lag_(?P<lag>\d+)(?P<over>\+?)$")
HIST_KEY_RE = re.compile(rf"^{re.escape(catalogue.LAG_FRAC)}batch/(?P<lag>\d+|over)$")


@dataclass(kw_only=True, slots=True)
class FigureBlock:
    """One section of the page: a figure as inline SVG, or the reason there is none."""

    anchor: str
    title: str
    svg: Any = None  # markupsafe.Markup of an inline <svg>, or None when there was nothing to plot
    empty: str = ""
    caption: str = ""


# -- numbers ---------------------------------------------------------------------------------------


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total = 0.0
    piece: tuple[float, float] | None = None  # the current piece of the union: (start, end)
    for start, end in sorted(intervals):
        if piece is None or start > piece[1]:
            if piece is not None:
                total += piece[1] - piece[0]
            piece = (start, end)
        else:
            piece = (piece[0], max(piece[1], end))
    if piece is not None:
        total += piece[1] - piece[0]
    return total


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def busy_fractions(spans: pd.DataFrame) -> dict[str, float]:
    """Per `who`: time covered by non-idle spans / the run's span window (first start..last end)."""
    if spans.empty:
        return {}
    window = float(spans["end"].max() - spans["start"].min())
    if window <= 0:
        return {}
    busy = spans[spans["kind"] != SpanKind.IDLE.value]
    return {
        who: union_length(zip(busy.loc[busy["who"] == who, "start"], busy.loc[busy["who"] == who, "end"])) / window
        for who in sorted(spans["who"].unique())
    }


def per_step(df: pd.DataFrame, key: str) -> pd.Series:
    """Mean of `key` per learner_step (several records per step, and repeats after a resume)."""
    if key not in df:
        return df.iloc[0:0]["learner_step"]
    return df.dropna(subset=[key]).groupby("learner_step")[key].mean()


def resume_points(df: pd.DataFrame) -> list[float]:
    """Elapsed times where learner_step went backwards: the run was resumed from a checkpoint."""
    steps = df["learner_step"].to_numpy()
    idx = np.nonzero(np.diff(steps) < 0)[0] + 1
    return [float(df["elapsed_s"].iloc[i]) for i in idx]


# -- figures ---------------------------------------------------------------------------------------


def _new_figure(ncols: int, nrows: int = 1, *, width: float = 12.0, height: float = 3.2) -> tuple[Figure, np.ndarray]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * nrows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    return fig, axes


def to_svg(fig: Figure) -> Any:
    import matplotlib
    from markupsafe import Markup

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: small and searchable
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    return Markup(svg[svg.index("<svg") :])


X_LABELS = {
    "learner_step": "learner step",
    "elapsed_s": "elapsed s",
    "policy_version": "policy version",
    "eval/elapsed_s": "training wall time (s)",
}


def _plot_keys(
    ax: Any, df: pd.DataFrame, keys: Sequence[str], *, x: str, title: str, resumes: Sequence[float] = ()
) -> bool:
    plotted = False
    for key in keys:
        if key not in df or not df[key].notna().any():
            continue
        series = per_step(df, key) if x == "learner_step" else df.dropna(subset=[key]).set_index(x)[key]
        ax.plot(series.index, series.to_numpy(), marker="." if len(series) < 60 else None, label=key)
        plotted = True
    if plotted and x == "elapsed_s":
        ax.ticklabel_format(axis="x", useOffset=False, style="plain")
        for t in resumes:
            ax.axvline(t, color="k", linestyle=":", linewidth=1)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(X_LABELS.get(x, x))
    if plotted:
        ax.legend(fontsize=7)
    else:
        ax.set_visible(False)
    return plotted


def _panels(
    df: pd.DataFrame, panels: Sequence[tuple[str, Sequence[str], str]], resumes: Sequence[float]
) -> Figure | None:
    """One subplot per (title, keys, x) with at least one logged key; None if none has data."""
    present = [p for p in panels if any(k in df and df[k].notna().any() for k in p[1])]
    if not present:
        return None
    ncols = min(3, len(present))
    fig, axes = _new_figure(ncols, -(-len(present) // ncols))
    for ax, (title, keys, x) in zip(axes, present):
        _plot_keys(ax, df, keys, x=x, title=title, resumes=resumes)
    for ax in axes[len(present) :]:
        ax.set_visible(False)
    return fig


def _lag_order(label: str) -> int:
    return 1 << 30 if label == "over" else int(label)  # the overflow bin last


def plot_staleness(df: pd.DataFrame) -> Figure | None:
    hist_cols = sorted((_lag_order(m["lag"]), c) for c in df.columns if (m := HIST_KEY_RE.match(c)))
    has_lag = any(k in df and df[k].notna().any() for k in ("staleness/lag_mean", "staleness/lag_max"))
    if not hist_cols and not has_lag:
        return None
    fig, axes = _new_figure(3)
    _plot_keys(
        axes[0],
        df,
        ["staleness/lag_mean", "staleness/lag_p90", "staleness/lag_max"],
        x="learner_step",
        title="lag at consume",
    )
    if hist_cols:
        rows = df.dropna(subset=[c for _, c in hist_cols], how="all")
        grid = rows[[c for _, c in hist_cols]].fillna(0.0).to_numpy().T  # [num_buckets, num_records]
        labels = [c.rsplit("/", 1)[1] for _, c in hist_cols]
        steps = rows["learner_step"].to_numpy()
        mesh = axes[1].pcolormesh(
            np.arange(grid.shape[1] + 1), np.arange(len(labels) + 1), grid, cmap="viridis", vmin=0, vmax=1
        )
        axes[1].set_yticks(np.arange(len(labels)) + 0.5, labels)
        ticks = np.linspace(0, len(steps) - 1, num=min(6, len(steps))).astype(int)
        axes[1].set_xticks(ticks + 0.5, [str(int(steps[i])) for i in ticks])
        axes[1].set(title="lag histogram over time (fraction of tokens)", xlabel="learner step", ylabel="lag")
        fig.colorbar(mesh, ax=axes[1])
        # numeric positions with the labels as ticks: lag labels like "0" would be category units
        axes[2].bar(np.arange(len(labels)), grid.mean(axis=1), color="#1f77b4")
        axes[2].set_xticks(np.arange(len(labels)), labels)
        axes[2].set(title="lag distribution (run mean)", xlabel="lag", ylabel="fraction")
    else:
        axes[1].set_visible(False)
        axes[2].set_visible(False)
    return fig


def plot_timeline(spans: pd.DataFrame) -> Figure | None:
    if spans.empty:
        return None
    whos = sorted(spans["who"].unique(), key=lambda w: (not w.startswith("engine"), w != "learner", w))
    fractions = busy_fractions(spans)
    fig, axes = _new_figure(1, height=0.5 * len(whos) + 1.6)
    ax = axes[0]
    many = len(spans) > 2000  # rasterize huge timelines so the SVG stays small
    for row, who in enumerate(whos):
        mine = spans[spans["who"] == who]
        for kind in SpanKind:
            sel = mine[mine["kind"] == kind.value]
            if sel.empty:
                continue
            merged = merge_intervals(zip(sel["start"], sel["end"]))
            ax.broken_barh(
                [(s, max(e - s, 1e-3)) for s, e in merged],
                (row - 0.4, 0.8),
                color=KIND_COLORS[kind],
                rasterized=many,
                label=kind.value,
            )
    ax.set_yticks(range(len(whos)), [f"{w} ({fractions.get(w, 0.0):.0%} busy)" for w in whos])
    ax.invert_yaxis()
    handles = {h.get_label(): h for h in ax.get_legend_handles_labels()[0]}
    ax.legend(
        handles.values(),
        handles.keys(),
        fontsize=8,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncols=len(handles),
        frameon=False,
    )
    ax.set_xlabel("elapsed s")
    return fig


def plot_sync(df: pd.DataFrame, spans: pd.DataFrame) -> Figure | None:
    parts = [k for k in ("sync/transfer_s", "sync/pause_s", "sync/load_s", "sync/resume_s") if k in df]
    rows = (
        df.dropna(subset=parts + (["sync/total_s"] if "sync/total_s" in df else []), how="all")
        if parts or "sync/total_s" in df
        else df.iloc[0:0]
    )
    sync_spans = (
        spans[(spans["kind"] == SpanKind.SYNC.value) & (spans["who"] == "learner")] if not spans.empty else spans
    )
    if rows.empty and sync_spans.empty:
        return None
    fig, axes = _new_figure(1, width=12, height=3.0)
    ax = axes[0]
    if not rows.empty:
        x, bottom = np.arange(len(rows)), np.zeros(len(rows))
        for key in parts:
            values = rows[key].fillna(0.0).to_numpy()
            ax.bar(x, values, bottom=bottom, label=key.split("/", 1)[1])
            bottom += values
        if "sync/total_s" in rows:
            ax.plot(x, rows["sync/total_s"].to_numpy(), "k_", markersize=12, label="total_s")
        ticks = np.unique(np.linspace(0, len(rows) - 1, num=min(20, len(rows))).round().astype(int))
        ax.set_xticks(ticks, [str(int(rows["learner_step"].iloc[i])) for i in ticks])
        ax.set_xlabel("sync after learner step")
    else:
        durations = (sync_spans["end"] - sync_spans["start"]).to_numpy()
        ax.bar(np.arange(len(durations)), durations, color=KIND_COLORS[SpanKind.SYNC], label="sync span")
        ax.set_xlabel("sync #")
    ax.set(ylabel="seconds", title="weight sync timings")
    ax.legend(fontsize=8)
    return fig


def plot_is_by_lag(df: pd.DataFrame) -> Figure | None:
    by_stat: dict[str, list[tuple[int, str, str]]] = {}
    for col in df.columns:
        if m := LAG_KEY_RE.match(col):
            by_stat.setdefault(m["stat"], []).append((int(m["lag"]), m["lag"] + m["over"], col))
    if not by_stat:
        return None
    stats = sorted(by_stat)[:6]
    fig, axes = _new_figure(min(3, len(stats)), -(-len(stats) // 3))
    for ax, stat in zip(axes, stats):
        entries = sorted(by_stat[stat])
        ax.bar(np.arange(len(entries)), [df[c].mean() for _, _, c in entries], color="#9467bd", width=0.6)
        ax.set_xticks(np.arange(len(entries)), [label for _, label, _ in entries])
        ax.set_xlim(-0.6, max(len(entries), 4) - 0.4)
        ax.set(title=f"is/{stat} by lag (run mean)", xlabel="lag")
    for ax in axes[len(stats) :]:
        ax.set_visible(False)
    return fig


def plot_remaining(df: pd.DataFrame, used: set[str], resumes: Sequence[float]) -> Figure | None:
    """Every numeric metric no other figure shows, one small panel each (per-lag/per-engine keys aside)."""
    skip = re.compile(rf"(/lag_\d+\+?$|^{re.escape(catalogue.LAG_FRAC)}|^engine/busy_fraction/)")
    rest = [c for c in df.columns if "/" in c and c not in used and not skip.search(c) and df[c].notna().any()]
    rest = sorted(rest)[:24]
    return _panels(df, [(c, [c], "learner_step") for c in rest], resumes)


PanelGroup = tuple[str, str, list[tuple[str, Sequence[str], str]], str]  # anchor, title, panels, caption


def _panel_groups(engine_cols: list[str], memory_cols: list[str]) -> list[PanelGroup]:
    """The report's line-panel sections: (anchor, title, [(panel title, metric keys, x key)], caption);
    `engine_cols` and `memory_cols` are the per-engine and per-part columns the run logged."""
    return [
        (
            "rollout",
            "Reward and rollouts",
            [
                ("reward by learner step", [REWARD_KEY, catalogue.EVAL_REWARD], "learner_step"),
                ("reward over time", [REWARD_KEY], "elapsed_s"),
                ("response length", ["rollout/response_len_mean"], "learner_step"),
                ("turns and tool calls", ["rollout/num_turns_mean", "rollout/tool_calls_mean"], "learner_step"),
                ("tool error rate", ["rollout/tool_error_rate"], "learner_step"),
                (
                    "trajectories per interval",
                    ["rollout/num_finished", "rollout/num_partial", "rollout/num_resumed", "rollout/num_failed"],
                    "elapsed_s",
                ),
            ],
            "Dotted vertical lines mark resumes (learner_step went backwards).",
        ),
        (
            "heldout",
            "Held-out evaluation (version-pinned)",
            [
                (
                    "held-out reward by policy version",
                    [catalogue.EVAL_REWARD, "eval/pass_at_1", "eval/pass_at_k"],
                    "policy_version",
                ),
                ("held-out reward over wall-clock", [catalogue.EVAL_REWARD, "eval/pass_at_k"], "eval/elapsed_s"),
            ],
            "Each point is one evaluation: every sample of it generated by one policy version (RUN_DIR/eval/).",
        ),
        (
            "throughput",
            "Throughput and utilization",
            [
                ("tokens/s", ["rollout/tokens_per_s", "learner/tokens_per_s"], "elapsed_s"),
                ("engine busy fraction", [ENGINE_BUSY_KEY, *engine_cols], "elapsed_s"),
                ("learner idle ratio", ["learner/idle_ratio"], "elapsed_s"),
                (
                    "buffer contents (trajectories)",
                    ["buffer/ready_trajectories", "buffer/partial_trajectories", "buffer/in_flight_trajectories"],
                    "elapsed_s",
                ),
            ],
            "",
        ),
        (
            "learner",
            "Learner",
            [
                ("loss", ["learner/loss"], "learner_step"),
                ("grad norm", ["learner/grad_norm"], "learner_step"),
                ("learning rate", ["learner/lr"], "learner_step"),
                ("step time (s)", ["learner/step_s", "learner/update_s"], "learner_step"),
                ("IS ratio", ["is/ratio_mean", "is/ratio_max"], "learner_step"),
                ("IS clip / mask / mismatch", ["is/clip_frac", "is/mask_frac", "is/mismatch_kl"], "learner_step"),
            ],
            "",
        ),
        (
            "memory",
            "Memory",
            [
                ("peak memory by part (GiB)", memory_cols, "learner_step"),
                ("learner resident set after each step (GiB)", ["memory/learner_rss_gb"], "learner_step"),
            ],
            "Peak RSS of each part (plus its child processes; GPU peaks where a part computes on CUDA). "
            "The learner's peak is per step, the other parts' since they started.",
        ),
    ]


def build_figures(df: pd.DataFrame, spans: pd.DataFrame, problems: list[str]) -> list[FigureBlock]:
    """All report sections in page order; failures are appended to `problems`."""
    resumes = resume_points(df)
    memory_cols = sorted(c for c in df.columns if c.startswith("memory/") and c.endswith("peak_gb"))
    engine_cols = sorted(c for c in df.columns if c.startswith(ENGINE_BUSY_KEY + "/"))
    groups = _panel_groups(engine_cols, memory_cols)
    used = {k for _, _, panels, _ in groups for _, keys, _ in panels for k in keys}
    used |= {c for c in df.columns if c.startswith(("staleness/lag_", "sync/"))}
    specs: list[tuple[str, str, Callable[[], Figure | None], str, str]] = [
        (anchor, title, functools.partial(_panels, df, panels, resumes), f"no {anchor} metrics were logged", caption)
        for anchor, title, panels, caption in groups
    ]
    specs += [
        (
            "staleness",
            "Staleness (lag at consume time)",
            lambda: plot_staleness(df),
            "no staleness/* metrics were logged",
            "lag = learner version − policy_version of each consumed token.",
        ),
        (
            "timeline",
            "Utilization timeline",
            lambda: plot_timeline(spans),
            "timeline.jsonl has no spans",
            "Busy = time covered by non-idle spans over the window from the first span start to the last span end.",
        ),
        (
            "sync",
            "Weight sync timings",
            lambda: plot_sync(df, spans),
            "no sync/* metrics or sync spans were logged",
            "",
        ),
        ("is", "Importance ratios by lag", lambda: plot_is_by_lag(df), "no is/*/lag_<k> metrics were logged", ""),
        ("other", "Other metrics", lambda: plot_remaining(df, used, resumes), "no other metrics", ""),
    ]
    return _render(specs, problems)


def _render(
    specs: list[tuple[str, str, Callable[[], Figure | None], str, str]], problems: list[str]
) -> list[FigureBlock]:
    """Draw each (anchor, title, make, empty text, caption) as an SVG block; a figure that fails is
    reported in `problems` and shown empty."""
    blocks = []
    for anchor, title, make, empty, caption in specs:
        try:
            fig = make()
            svg = to_svg(fig) if fig is not None else None
        except Exception as exc:  # fault boundary: one bad figure must not lose the whole report
            logger.warning("report figure %s failed: %s", anchor, exc)
            problems.append(f"figure '{title}' failed: {type(exc).__name__}: {exc}")
            svg = None
        blocks.append(FigureBlock(anchor=anchor, title=title, svg=svg, empty=empty, caption=caption if svg else ""))
    return blocks
