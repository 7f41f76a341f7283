"""What the buffer reports: its event counters, the lag histograms of what was trained, and the
length distributions of what was generated, trained and dropped (`ReplayBuffer.stats`)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from streamrl.core.catalogue import LAG_FRAC
from streamrl.core.versions import lag_fractions, lag_histogram, token_lag


class BufferStats:
    """Counters and histograms kept beside the row store; `ReplayBuffer.stats` merges them with the
    row store's and group table's gauges."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.counts: Counter[str] = Counter()
        self.token_lag_hist = np.zeros(max_staleness + 2, dtype=np.int64)  # last bin: over max_staleness
        self.traj_lag_hist = np.zeros(max_staleness + 2, dtype=np.int64)
        self.last_batch: dict[str, float] = {}
        self.trained_lengths: Counter[int] = Counter()  # length bucket -> trajectories at their first use
        self.dropped_lengths: Counter[int] = Counter()  # length bucket -> trajectories dropped over age

    def account_batch(
        self, table: pa.Table, row_lags: np.ndarray, served_version: int, *, now: float | None = None
    ) -> None:
        """Token and trajectory lags of one sampled batch, relative to the version it is served at;
        how many versions each trajectory spans and how often it was interrupted; its time in
        flight (created → finished) and in the queue (finished → sampled, at `now`)."""
        versions = table.column("policy_versions").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        token_lags = token_lag(served_version, versions.astype(np.int64))
        self.token_lag_hist += lag_histogram(token_lags, self.max_staleness)
        self.traj_lag_hist += lag_histogram(row_lags, self.max_staleness)
        sampled = token_lags[token_lags >= 0]
        self.last_batch = {
            "staleness/batch_token_lag_mean": float(sampled.mean()) if len(sampled) else 0.0,
            "staleness/batch_token_lag_max": float(sampled.max()) if len(sampled) else 0.0,
            "staleness/batch_trajectory_lag_max": float(np.max(row_lags)) if len(row_lags) else 0.0,
        }
        if table.num_rows:
            lo, hi = (table.column(c).to_numpy().astype(np.int64) for c in ("min_policy_version", "max_policy_version"))
            span = np.where(lo >= 0, hi - lo, 0)
            created, finished = (table.column(c).to_numpy() for c in ("created_at", "finished_at"))
            now = time.time() if now is None else now
            self.last_batch.update(
                {
                    "staleness/batch_version_span_mean": float(span.mean()),
                    "staleness/batch_version_span_max": float(span.max()),
                    "staleness/batch_interrupts_mean": float(table.column("num_interrupts").to_numpy().mean()),
                    "staleness/batch_in_flight_s_mean": float(np.mean(finished - created)),
                    "staleness/batch_in_queue_s_mean": float(np.mean(now - finished)),
                }
            )

    def snapshot(
        self, groups: Any, *, live_rows: int, memory_bytes: int, chunks: int, recovery: Any
    ) -> dict[str, float]:
        """`ReplayBuffer.stats`: these counters and histograms with the group table's (`groups`) and the
        row store's gauges and the recovery report's totals."""
        c, g = self.counts, groups
        out = {
            "buffer/rows_appended": c["rows_appended"],
            "buffer/live_rows": live_rows,
            "buffer/ready_trajectories": g.num_ready_trajectories,
            "buffer/ready_groups": len(g.ready),
            "buffer/partial_trajectories": g.num_partial,
            "buffer/in_flight_trajectories": g.num_in_flight,
            "buffer/accepted_trajectories": g.num_accepted,
            "buffer/trajectories_consumed": c["trajectories_consumed"],
            "buffer/batches_sampled": c["batches_sampled"],
            "buffer/evicted_over_age": c["evicted_over_age"],
            "buffer/over_age_kept": c["over_age_kept"],
            "buffer/over_age_trained": c["over_age_trained"],
            "buffer/groups_over_token_budget": c["groups_over_token_budget"],
            "buffer/late_rows_ignored": g.num_late_rows,
            "buffer/stale_attempt_rows": g.num_stale_attempt_rows,
            "buffer/flushes": c["flushes"],
            "buffer/memory_bytes": memory_bytes,
            "buffer/chunks": chunks,
            "buffer/recovered_rows": recovery.num_rows,
            "buffer/recovery_problems": len(recovery.lines()) - 1,
        }
        out.update({f"buffer/groups_{phase.value}": n for phase, n in g.counts.items()})
        generated = sum(g.generated_lengths.values())
        out["buffer/trajectories_generated"] = generated  # finished members of settled groups
        out["buffer/trajectories_trained"] = g.num_trained  # ... of groups the learner used
        out["buffer/gradient_share"] = g.num_trained / generated if generated else 0.0
        out.update(self.staleness())
        out.update(self.lengths(g.generated_lengths))
        return {k: float(v) for k, v in out.items()}

    def staleness(self) -> dict[str, float]:
        """Lag shares (`staleness/lag_frac/{tokens,trajectories}/<k>`, `.../over`) and means over
        everything trained so far."""
        out: dict[str, float] = {}
        for name, scope, hist in (
            ("token_lag", "tokens", self.token_lag_hist),
            ("trajectory_lag", "trajectories", self.traj_lag_hist),
        ):
            out.update(lag_fractions(hist, f"{LAG_FRAC}{scope}/"))
            out[f"staleness/{name}_mean"] = float(np.dot(np.arange(len(hist)), hist) / max(int(hist.sum()), 1))
        out.update(self.last_batch)
        return out

    def lengths(self, generated: Counter[int]) -> dict[str, float]:
        """Generated vs trained length distributions (tokens per trajectory, power-of-two buckets):
        `staleness/length_bias` = trained mean / generated mean (1.0 = no bias towards short ones)."""
        out: dict[str, float] = {}
        means = {}
        for name, hist in (
            ("generated", generated),
            ("trained", self.trained_lengths),
            ("dropped_over_age", self.dropped_lengths),
        ):
            total = sum(hist.values())
            means[name] = sum(b * n for b, n in hist.items()) / total if total else 0.0
            out[f"length/{name}_mean_bucket"] = means[name]
            for bucket, n in hist.items():
                out[f"length/{name}_le_{bucket}"] = n
        if means["generated"] and means["trained"]:
            out["staleness/length_bias"] = means["trained"] / means["generated"]
        return out
