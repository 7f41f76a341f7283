"""`streamrl buffer ...`: read a buffer directory for analysis, without opening it as a writer.

    streamrl buffer export DIR --parquet OUT    every logged row (all versions of every trajectory)
    streamrl buffer stats DIR                   counts, lag histogram, reward and length summaries

`load_table` / `load_dataset` / `load_frame` give the same rows to notebooks. Beside the
`TRAJECTORY_SCHEMA` columns each row has `segment`, `log_index` (write order), `is_latest` (the row
the buffer kept of its trajectory: of the rows of its newest attempt so far, its first finished or
failed row, else its last partial row; `buffer.groups.kept_rows`) and `num_consumed` / `last_consume_step`
(consumption that survived rollbacks). Reading never modifies the directory; problems found in it
(torn tails, checksum failures) are listed by `stats`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from streamrl.buffer import arrow_compute as pc
from streamrl.buffer.groups import kept_rows
from streamrl.buffer.log import read_segments
from streamrl.buffer.manifest import (
    CONSUMED_PREFIX,
    CONSUMPTION_SCHEMA,
    TRAJ_PREFIX,
    consumption_by_step,
    consumption_history,
)
from streamrl.buffer.schema import LEGACY_SCHEMAS, TRAJECTORY_SCHEMA, normalize_batch
from streamrl.buffer.types import RecoveryReport
from streamrl.core.versions import lag_histogram

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow.dataset as ds


def read_dir(buffer_dir: str | Path) -> tuple[pa.Table, dict[str, list[tuple[int, int]]], RecoveryReport]:
    """Every logged row (with its segment name), the surviving consumption history
    (trajectory_id -> [(learner_step, lag)]) and what reading found wrong in the log."""
    table, cons, report = _read_logs(buffer_dir)
    return table, consumption_history(cons), report


def logged_steps(buffer_dir: str | Path) -> tuple[pa.Table, dict[int, list[tuple[int, int]]]]:
    """Every logged row (as `read_dir`) and, for every learner step that trained, its batch as
    [(row index in that table, lag)] in the order the batch had: the row of each trajectory that the
    buffer kept (a late duplicate it ignored is never the one trained), rollbacks applied."""
    table, cons, _ = _read_logs(buffer_dir)
    tids = table.column("trajectory_id").to_pylist()
    kept = {tids[i]: i for i in _kept(table).tolist()}
    return table, {step: [(kept[tid], lag) for tid, lag in uses] for step, uses in consumption_by_step(cons).items()}


def _read_logs(buffer_dir: str | Path) -> tuple[pa.Table, list[pa.RecordBatch], RecoveryReport]:
    root = Path(buffer_dir)
    if not root.is_dir():
        raise ValueError(f"{root} is not a buffer directory")
    report = RecoveryReport()
    names, batches = [], []
    for name, batch in read_segments(
        root, prefix=TRAJ_PREFIX, schema=TRAJECTORY_SCHEMA, report=report, legacy_schemas=LEGACY_SCHEMAS
    ):
        if not batch.schema.equals(TRAJECTORY_SCHEMA):
            batch = normalize_batch(batch)  # schema "1": empty image columns
        names.extend([name] * batch.num_rows)
        batches.append(batch)
        report.num_rows += batch.num_rows
    cons = [b for _, b in read_segments(root, prefix=CONSUMED_PREFIX, schema=CONSUMPTION_SCHEMA, report=report)]
    report.num_consumption_records = sum(b.num_rows for b in cons)
    table = pa.Table.from_batches(batches, schema=TRAJECTORY_SCHEMA)
    return table.append_column("segment", pa.array(names, pa.string())), cons, report


def _kept(table: pa.Table) -> np.ndarray:
    columns = ("trajectory_id", "status", "attempt")
    return np.array(kept_rows(*(table.column(c).to_pylist() for c in columns)), dtype=np.int64)


def latest_rows(table: pa.Table) -> pa.Table:
    """The row the buffer kept of each trajectory (`buffer.groups.kept_rows`), in log order."""
    return table.take(_kept(table)) if table.num_rows else table


def load_table(buffer_dir: str | Path) -> pa.Table:
    table, history, _ = read_dir(buffer_dir)
    n = table.num_rows
    table = table.append_column("log_index", pa.array(np.arange(n, dtype=np.int64)))
    table = table.append_column("is_latest", pc.is_in(table.column("log_index"), value_set=pa.array(_kept(table))))
    tids = table.column("trajectory_id").to_pylist()
    uses = [history.get(t, []) for t in tids]
    table = table.append_column("num_consumed", pa.array([len(u) for u in uses], pa.int32()))
    return table.append_column(
        "last_consume_step", pa.array([max((s for s, _ in u), default=-1) for u in uses], pa.int64())
    )


def load_dataset(buffer_dir: str | Path) -> ds.Dataset:
    import pyarrow.dataset as ds

    return ds.dataset(load_table(buffer_dir))


def load_frame(buffer_dir: str | Path) -> pd.DataFrame:
    return load_table(buffer_dir).to_pandas()


def export(buffer_dir: str | Path, parquet_out: str | Path) -> int:
    """Write every logged row to one Parquet file; returns the number of rows."""
    import pyarrow.parquet as pq

    table = load_table(buffer_dir)
    Path(parquet_out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, parquet_out)
    return table.num_rows


def _summary(name: str, values: np.ndarray) -> str:
    if not len(values):
        return f"{name}: n=0"
    p50, p90 = np.percentile(values, [50, 90])
    return (
        f"{name}: n={len(values)} mean={values.mean():.4g} std={values.std():.4g} min={values.min():.4g} "
        f"p50={p50:.4g} p90={p90:.4g} max={values.max():.4g}"
    )


def stats(buffer_dir: str | Path) -> str:
    """A human-readable report of a buffer directory."""
    table, history, report = read_dir(buffer_dir)
    lines = [f"buffer {buffer_dir}", *report.lines()]
    latest = latest_rows(table)
    status_counts = dict(zip(*np.unique(latest.column("status").to_numpy(zero_copy_only=False), return_counts=True)))
    num_groups = len(pc.unique(latest.column("group_id")))
    lines.append(f"rows logged: {table.num_rows}, trajectories: {latest.num_rows}, groups: {num_groups}")
    lines.append("latest status: " + (", ".join(f"{k}={v}" for k, v in sorted(status_counts.items())) or "none"))
    lags = np.array([lag for uses in history.values() for _, lag in uses], dtype=np.int64)
    lines.append(f"consumed: {len(history)} trajectories, {len(lags)} uses")
    if len(lags):
        hist = lag_histogram(lags, int(lags.max()))[:-1]
        lines.append(
            "lag at consume (trajectory, oldest token): " + " ".join(f"{k}:{n}" for k, n in enumerate(hist.tolist()))
        )
    finished = latest.filter(pc.equal(latest.column("status"), "finished"))
    lines.append(_summary("reward (finished)", finished.column("reward").to_numpy()))
    lines.append(_summary("response tokens (finished)", finished.column("num_response_tokens").to_numpy()))
    lines.append(_summary("prompt tokens (finished)", finished.column("num_prompt_tokens").to_numpy()))
    lo, hi = (finished.column(c).to_numpy().astype(np.int64) for c in ("min_policy_version", "max_policy_version"))
    lines.append(_summary("versions spanned per trajectory (finished)", np.where(lo >= 0, hi - lo, 0)))
    lines.append(_summary("interruptions per trajectory (finished)", finished.column("num_interrupts").to_numpy()))
    lines.append(
        _summary(
            "seconds in flight (finished)",
            finished.column("finished_at").to_numpy() - finished.column("created_at").to_numpy(),
        )
    )
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `buffer export DIR --parquet OUT` and `buffer stats DIR`; each sets `func(args) -> int`."""
    parser = subparsers.add_parser("buffer", help="inspect and export a replay buffer directory")
    sub = parser.add_subparsers(dest="buffer_command", required=True)
    p_export = sub.add_parser("export", help="write every logged row to Parquet")
    p_export.add_argument("dir")
    p_export.add_argument("--parquet", required=True, help="output .parquet path")
    p_export.set_defaults(func=_run_export)
    p_stats = sub.add_parser("stats", help="print counts, lag histogram, reward and length summaries")
    p_stats.add_argument("dir")
    p_stats.set_defaults(func=_run_stats)


def _run_export(args: argparse.Namespace) -> int:
    n = export(args.dir, args.parquet)
    print(f"wrote {n} rows to {args.parquet}")
    return 0


def _run_stats(args: argparse.Namespace) -> int:
    print(stats(args.dir))
    return 0
