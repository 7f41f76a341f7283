"""`streamrl staleness RUN_DIR`: how stale was what a run trained on, from its durable buffer alone.

Reads the trajectory log and the consumption log (never opens the buffer as a writer) and reports:
- trajectory lag at consume (served version − the trajectory's oldest token version, as recorded at
  each use) and token lag at consume (served version − each sampled token's version);
- versions spanned per finished trajectory (newest − oldest token version) and its interruptions;
- length bias: response tokens of what was generated (every finished trajectory) vs what was trained
  (each use), by power-of-two bucket, and the ratio of the means;
- reward per trajectory-lag bucket of what was trained.

A trajectory's served version at a use is `lag + min_policy_version` (the lag is recorded against
it), so no learner state is needed. Writes RUN_DIR/staleness.json and RUN_DIR/staleness.html.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.buffer import arrow_compute as pc
from streamrl.buffer.admission import length_bucket
from streamrl.buffer.cli import latest_rows, read_dir
from streamrl.core.run_dir import RunDir
from streamrl.core.versions import token_lag


def _counts(values) -> dict[str, int]:
    return {str(k): int(v) for k, v in sorted(Counter(int(x) for x in values).items())}


def analyze(buffer_dir: str | Path) -> dict[str, Any]:
    table, history, report = read_dir(buffer_dir)
    latest = latest_rows(table)
    finished = latest.filter(pc.equal(latest.column("status"), "finished"))
    rows = finished.to_pydict()
    by_id = {tid: i for i, tid in enumerate(rows["trajectory_id"])}
    traj_lags, token_lags, trained_lengths, rewards_by_lag = [], [], [], {}
    for tid, uses in history.items():
        i = by_id.get(tid)
        if i is None:  # consumed, but its finished row was not recovered (listed by `buffer stats`)
            continue
        versions = np.asarray(rows["policy_versions"][i], dtype=np.int64)
        sampled = versions[np.asarray(rows["response_mask"][i], dtype=bool)]
        for _, lag in uses:
            served = lag + rows["min_policy_version"][i]
            traj_lags.append(lag)
            token_lags.extend(int(x) for x in token_lag(served, sampled))
            trained_lengths.append(rows["num_response_tokens"][i])
            rewards_by_lag.setdefault(lag, []).append(rows["reward"][i])
    lo, hi = np.array(rows["min_policy_version"], dtype=np.int64), np.array(rows["max_policy_version"], dtype=np.int64)
    generated = np.array(rows["num_response_tokens"], dtype=np.int64)
    gen_mean = float(generated.mean()) if len(generated) else 0.0
    trained_mean = float(np.mean(trained_lengths)) if trained_lengths else 0.0
    return {
        "buffer_dir": str(buffer_dir),
        "log_problems": report.lines()[1:],
        "finished_trajectories": finished.num_rows,
        "consumed_trajectories": sum(1 for t in history if t in by_id),
        "uses": len(traj_lags),
        "trajectory_lag_at_consume": _counts(traj_lags),
        "token_lag_at_consume": _counts(token_lags),
        "version_span": _counts(np.where(lo >= 0, hi - lo, 0)),
        "interruptions": _counts(rows["num_interrupts"]),
        "length": {
            "generated_mean_tokens": gen_mean,
            "trained_mean_tokens": trained_mean,
            "trained_over_generated": trained_mean / gen_mean if gen_mean and trained_mean else None,
            "generated_by_bucket": _counts(length_bucket(n) for n in generated),
            "trained_by_bucket": _counts(length_bucket(n) for n in trained_lengths),
        },
        "reward_by_trajectory_lag": {
            str(lag): {"uses": len(r), "mean": float(np.mean(r))} for lag, r in sorted(rewards_by_lag.items())
        },
    }


def _bars(title: str, counts: dict[str, int], label: str) -> str:
    total = max(sum(counts.values()), 1)
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v}</td><td><div class=bar style='width:{300 * v / total:.0f}px'></div>"
        f"</td><td>{100 * v / total:.1f} %</td></tr>"
        for k, v in counts.items()
    )
    return (
        f"<h2>{html.escape(title)}</h2><table><tr><th>{label}</th><th>n</th><th></th><th>share</th></tr>{rows}</table>"
    )


def render_html(result: dict[str, Any]) -> str:
    length = result["length"]
    ratio = length["trained_over_generated"]
    reward_rows = "".join(
        f"<tr><td>{k}</td><td>{v['uses']}</td><td>{v['mean']:.3f}</td></tr>"
        for k, v in result["reward_by_trajectory_lag"].items()
    )
    parts = [
        "<!doctype html><meta charset=utf-8><title>streamrl staleness</title>",
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:left}"
        ".bar{height:10px;background:#4c78a8}</style>",
        f"<h1>Staleness of {html.escape(result['buffer_dir'])}</h1>",
        f"<p>{result['finished_trajectories']} finished trajectories, {result['consumed_trajectories']} trained "
        f"({result['uses']} uses).</p>",
        _bars("Trajectory lag at consume (oldest token)", result["trajectory_lag_at_consume"], "lag"),
        _bars("Token lag at consume", result["token_lag_at_consume"], "lag"),
        _bars("Versions spanned per finished trajectory", result["version_span"], "versions"),
        _bars("Interruptions per finished trajectory", result["interruptions"], "interruptions"),
        "<h2>Length bias</h2>"
        f"<p>generated mean {length['generated_mean_tokens']:.1f} tokens, "
        f"trained mean {length['trained_mean_tokens']:.1f}"
        + (f", ratio {ratio:.3f} (1.0 = no bias)" if ratio is not None else "")
        + "</p>",
        _bars("Generated, by response-length bucket", length["generated_by_bucket"], "≤ tokens"),
        _bars("Trained, by response-length bucket", length["trained_by_bucket"], "≤ tokens"),
        "<h2>Reward by trajectory lag</h2>"
        f"<table><tr><th>lag</th><th>uses</th><th>mean reward</th></tr>{reward_rows}</table>",
    ]
    if result["log_problems"]:
        parts.append(
            "<h2>Log problems</h2><ul>"
            + "".join(f"<li>{html.escape(p)}</li>" for p in result["log_problems"])
            + "</ul>"
        )
    return "\n".join(parts)


def write_report(run_dir: str | Path) -> tuple[Path, Path, dict[str, Any]]:
    """RUN_DIR/staleness.json and .html from RUN_DIR/buffer (or RUN_DIR itself if it is a buffer)."""
    run_dir = Path(run_dir)
    buffer_dir = RunDir(run_dir).buffer if RunDir(run_dir).buffer.is_dir() else run_dir
    result = analyze(buffer_dir)
    json_path, html_path = RunDir(run_dir).staleness_json, RunDir(run_dir).staleness_html
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    html_path.write_text(render_html(result))
    return json_path, html_path, result


def summary(result: dict[str, Any]) -> str:
    length = result["length"]
    ratio = length["trained_over_generated"]
    return "\n".join(
        [
            f"{result['finished_trajectories']} finished trajectories, "
            f"{result['consumed_trajectories']} trained ({result['uses']} uses)",
            "trajectory lag at consume: "
            + " ".join(f"{k}:{v}" for k, v in result["trajectory_lag_at_consume"].items()),
            "token lag at consume:      " + " ".join(f"{k}:{v}" for k, v in result["token_lag_at_consume"].items()),
            "versions spanned:          " + " ".join(f"{k}:{v}" for k, v in result["version_span"].items()),
            f"length: generated mean {length['generated_mean_tokens']:.1f}, "
            f"trained mean {length['trained_mean_tokens']:.1f}" + (f", ratio {ratio:.3f}" if ratio is not None else ""),
            "reward by trajectory lag:  "
            + " ".join(f"{k}:{v['mean']:.3f} (n={v['uses']})" for k, v in result["reward_by_trajectory_lag"].items()),
        ]
    )
