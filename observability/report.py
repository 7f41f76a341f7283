"""Offline HTML run report: `streamrl report RUN_DIR` -> `RUN_DIR/report.html`.

Reads what `MetricsLogger` (metrics.py) wrote — metrics.jsonl, timeline.jsonl, samples.jsonl — and
run_info.json from the driver, and renders one self-contained page (inline CSS, matplotlib figures as
inline SVG, no scripts, no CDN): a summary table, plots of reward, staleness, utilization timeline,
sync timings, IS ratios by lag, throughput and learner stats, every other logged metric, and a
trajectory viewer that decodes each sampled token with the run's tokenizer and colours it by
response mask and policy_version; for a VLM run each image is a chip with a thumbnail read from the
run's buffer image log (`RUN_DIR/buffer` unless the config names another `buffer.root_dir`).

A run killed mid-way is normal input: missing files, torn last lines and absent metrics are listed
as problems at the top of the page and every section shows what it can.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.core import catalogue
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.observability.metrics import ENGINE_BUSY_KEY, REWARD_KEY
from streamrl.observability.report_figures import build_figures, busy_fractions, per_step, resume_points
from streamrl.observability.report_images import load_viewer_images
from streamrl.observability.report_timeline import timeline_blocks
from streamrl.observability.report_tokens import load_tokenizer
from streamrl.observability.report_viewer import VERSION_COLORS, fmt_number, pick_samples, render_trajectory

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

TEMPLATE_FILE = Path(__file__).with_name("report_template.html.jinja")


@dataclass(kw_only=True, slots=True)
class RunData:
    """Everything read from a run directory; `problems` explains whatever was missing or torn."""

    run_dir: Path
    info: RunInfo | None  # None: missing or unreadable (`problems` says which)
    metrics: pd.DataFrame  # [num_records, num_keys]; sorted by file order; null -> NaN
    spans: pd.DataFrame  # [num_spans, 4]: kind, who, start, end (elapsed seconds)
    samples: list[dict[str, Any]]  # Trajectory.to_dict() + learner_step
    problems: list[str] = field(default_factory=list)


# -- reading ---------------------------------------------------------------------------------------


def read_jsonl(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    """Rows of a JSONL file; torn or malformed lines are skipped and reported."""
    if not path.exists():
        problems.append(f"{path.name} is missing")
        return []
    rows, num_bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                num_bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                num_bad += 1
    if num_bad:
        problems.append(f"{path.name}: skipped {num_bad} unreadable line(s) (e.g. torn by a kill)")
    if not rows:
        problems.append(f"{path.name} has no records")
    return rows


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; ValueError only if it does not exist."""
    import pandas as pd

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    problems: list[str] = []
    run = RunDir(run_dir)
    info = None
    if not run.run_info.exists():
        problems.append(f"{run.run_info.name} is missing (no run name, model or config)")
    else:
        try:
            info = run.info()
        except (OSError, ValueError) as exc:
            problems.append(f"{run.run_info.name} is unreadable: {exc}")
    metrics = pd.DataFrame(read_jsonl(run.metrics, problems))
    for col in ("learner_step", "elapsed_s", "policy_version"):
        if col not in metrics:
            metrics[col] = pd.Series(dtype=float)
    metrics = metrics.apply(pd.to_numeric, errors="coerce")
    spans = pd.DataFrame(read_jsonl(run.timeline, problems), columns=["kind", "who", "start", "end"])
    spans = spans.dropna()
    samples = [s for s in read_jsonl(run.samples, problems) if isinstance(s.get("response_ids"), list)]
    return RunData(run_dir=run_dir, info=info, metrics=metrics, spans=spans, samples=samples, problems=problems)


# -- summary ---------------------------------------------------------------------------------------


def _col_mean(df: pd.DataFrame, key: str) -> float | None:
    return float(df[key].mean()) if key in df and df[key].notna().any() else None


def _col_sum(df: pd.DataFrame, key: str) -> float | None:
    return float(df[key].sum()) if key in df and df[key].notna().any() else None


def _first_last(series: pd.Series) -> str:
    """`0.539 at step 0 → 0.562 at step 6` (one value when the run evaluated once)."""
    ends = [(series.index[0], series.iloc[0])] + ([(series.index[-1], series.iloc[-1])] if len(series) > 1 else [])
    return " → ".join(f"{fmt_number(float(v))} at step {int(step)}" for step, v in ends)


def summary_rows(data: RunData) -> list[tuple[str, str]]:
    df, info = data.metrics, data.info
    rewards = per_step(df, REWARD_KEY)
    k = max(1, min(3, len(rewards) // 2)) if len(rewards) else 0
    wall = max(
        [float(df["elapsed_s"].max()) if df["elapsed_s"].notna().any() else 0.0]
        + ([float(data.spans["end"].max())] if not data.spans.empty else [])
    )
    busy = _col_mean(df, ENGINE_BUSY_KEY)
    if busy is None:
        engines = {w: f for w, f in busy_fractions(data.spans).items() if w.startswith("engine")}
        busy = float(np.mean(list(engines.values()))) if engines else None
    syncs = df["sync/total_s"].dropna() if "sync/total_s" in df else []
    rows = [
        ("run", info.run_name if info else data.run_dir.name),
        ("mode", info.mode if info else "–"),
        ("model", info.model_path if info else "–"),
        ("started", datetime.fromtimestamp(info.started_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if info else "–"),
        ("wall time", f"{wall:.1f} s ({wall / 60:.1f} min)"),
        ("learner steps", fmt_number(df["learner_step"].max(), ".0f")),
        ("final policy_version", fmt_number(df["policy_version"].max(), ".0f")),
        (f"initial reward (mean of first {k} steps)", fmt_number(float(rewards.iloc[:k].mean()) if k else None)),
        (f"final reward (mean of last {k} steps)", fmt_number(float(rewards.iloc[-k:].mean()) if k else None)),
    ]
    heldout = per_step(df, catalogue.EVAL_REWARD)
    if not heldout.empty:  # data.eval_num_prompts > 0
        rows.append(("held-out reward (first → last evaluation)", _first_last(heldout)))
    for name in ("finished", "partial", "resumed", "failed"):
        rows.append((f"trajectories {name}", fmt_number(_col_sum(df, f"rollout/num_{name}"), ".0f")))
    rows += [
        ("rollout tokens/s (mean)", fmt_number(_col_mean(df, "rollout/tokens_per_s"), ".1f")),
        ("learner tokens/s (mean)", fmt_number(_col_mean(df, "learner/tokens_per_s"), ".1f")),
        ("engine busy fraction (mean)", fmt_number(busy, ".1%")),
        ("learner idle ratio (mean)", fmt_number(_col_mean(df, "learner/idle_ratio"), ".1%")),
        (
            "lag at consume (mean / max)",
            f"{fmt_number(_col_mean(df, 'staleness/lag_mean'), '.2f')} / "
            f"{fmt_number(df['staleness/lag_max'].max() if 'staleness/lag_max' in df else None, '.0f')}",
        ),
        (
            "weight syncs (count, mean total s)",
            f"{len(syncs)}, {fmt_number(float(np.mean(syncs)) if len(syncs) else None)}",
        ),
        (
            "peak memory by part (GiB)",
            ", ".join(
                f"{c[len('memory/') : -len('_peak_gb')]} {df[c].max():.2f}"
                for c in sorted(df.columns)
                if c.startswith("memory/") and c.endswith("_peak_gb") and df[c].notna().any()
            )
            or "–",
        ),
        ("resumes detected", str(len(resume_points(df)))),
        ("sampled trajectories", str(len(data.samples))),
    ]
    return rows


# -- page ------------------------------------------------------------------------------------------


def buffer_dir(data: RunData) -> Path:
    """Where the run's buffer (and its image log) lives: the config's `buffer.root_dir`, else RUN_DIR/buffer."""
    buffer_cfg = data.info.config.get("buffer") if data.info else None
    root = buffer_cfg.get("root_dir") if isinstance(buffer_cfg, dict) else None
    return Path(root) if isinstance(root, str) and root else RunDir(data.run_dir).buffer


def write_report(
    run_dir: str | Path,
    *,
    max_trajectories: int = 24,
    max_tokens: int = 2048,
    max_image_px: int = 128,
    max_image_bytes: int = 2 * 1024 * 1024,
) -> Path:
    """Render `run_dir/report.html` from whatever the run wrote; returns its path.

    Raises ValueError only if `run_dir` is not a directory; anything missing inside it is listed
    at the top of the page. Image thumbnails have their longest side capped at `max_image_px` and
    take at most `max_image_bytes` (base64) of the page; the rest are chips without a thumbnail.
    """
    import jinja2

    data = load_run(run_dir)
    figures = build_figures(data.metrics, data.spans, data.problems) + timeline_blocks(data.run_dir, data.problems)
    picked = pick_samples(data.samples, max_trajectories)
    model_path = data.info.model_path if data.info else None
    tokenizer = load_tokenizer(model_path, data.problems) if picked else None
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    images = (
        load_viewer_images(
            model_path,
            tokenizer,
            buffer_dir(data),
            picked,
            data.problems,
            max_px=max_image_px,
            budget_bytes=max_image_bytes,
        )
        if picked
        else None
    )
    trajectories = [
        render_trajectory(row, tokenizer, special_ids=special_ids, max_tokens=max_tokens, images=images)
        for row in picked
    ]
    if images is not None:
        data.problems.extend(images.problems)
    versions = sorted({v for t in trajectories for v in t["versions"]})
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    html = env.from_string(TEMPLATE_FILE.read_text()).render(
        title=data.info.run_name if data.info else data.run_dir.name,
        subtitle=f"{data.info.mode if data.info else '?'} mode · {data.run_dir}",
        problems=data.problems,
        summary=summary_rows(data),
        figures=figures,
        version_colors=VERSION_COLORS,
        version_legend=[(v, f"v{v % len(VERSION_COLORS)}") for v in versions],
        trajectories=trajectories,
        trajectories_empty="no sampled trajectories (samples.jsonl)" if not data.samples else "",
        has_images=images is not None and images.num_chips > 0,  # else the page is exactly a text run's
        images_note=images.note if images is not None else "",
    )
    out = RunDir(data.run_dir).report
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)
    if data.problems:
        logger.warning("report for %s is incomplete: %s", data.run_dir, "; ".join(data.problems))
    logger.info(
        "wrote %s (%d figures, %d trajectories)", out, sum(f.svg is not None for f in figures), len(trajectories)
    )
    return out
