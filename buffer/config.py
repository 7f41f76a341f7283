"""Configuration of the replay buffer (the `[buffer]` table of a run file).

Batch shape: `batch_size` trajectories per learner step, made of whole GRPO groups of `group_size`
samples (so `batch_size % group_size == 0`); with `max_batch_tokens` set, batches are cut by a token
budget instead (prompt + response tokens), still of whole groups, at most `batch_size` trajectories;
a group larger than the budget is trained in a batch of its own (counted, `buffer.sampling`).

Durability: rows are flushed to the log (written to the OS, survive a process kill) every
`flush_every_rows` rows or `flush_every_ms` milliseconds, whichever comes first; `checkpoint()` also
fsyncs (survives a machine crash) when `fsync_on_checkpoint`. An append with `durable=True` (admission's
PENDING rows before the cursor is saved, a tool's journalled intent before the tool runs) is flushed
and, with `fsync_durable_appends`, fsynced before it returns: what those callers acknowledge survives
a power loss too, not only a process kill (one fsync per admitted group or journalled tool call).
`root_dir = None` keeps everything in memory only.

Capacity: `capacity_rows` bounds the live rows. Appends that add rows wait for room (replacing a
partial row never does), and admission (`ReplayBuffer.capacity`) starts no group that does not fit,
so it must hold one batch waiting to be sampled plus one group in flight.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingPolicy(StrEnum):
    FIFO = "fifo"  # oldest-started complete group first (default; what admission control assumes)
    UNIFORM = "uniform"  # uniformly random among the ready groups
    PRIORITIZED = "prioritized"  # weight = (reward std + priority_eps) * lag_decay ** lag


class AdmissionRule(StrEnum):
    """How admission counts the groups still in flight (`buffer.admission.rollout_capacity`)."""

    BOUND = "bound"  # every admitted trajectory will be consumed: max_staleness is a hard bound at start
    # each in-flight trajectory counts by the recent share of settled groups kept for training, so
    # groups the DAPO filter drops no longer shrink the window: max_staleness holds in expectation
    EXPECTED = "expected"


class OverAgePolicy(StrEnum):
    TRAIN = "train"  # sample it anyway; the learner's lag-aware correction handles the extra lag
    EVICT = "evict"  # drop from memory (the rows stay in the log), counted and logged
    KEEP = "keep"  # keep in memory for analysis, never sampled, counted and logged


class BufferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    root_dir: str | None = None  # None = memory only (no log, no recovery)
    max_staleness: int = Field(default=4, ge=0)  # max served_version - min policy_version at consume
    batch_size: int = Field(default=64, gt=0)  # trajectories per learner step
    group_size: int = Field(default=8, gt=0)  # GRPO n: samples per prompt
    max_batch_tokens: int | None = Field(default=None, gt=0)  # token-budget batching when set
    sampling: SamplingPolicy = SamplingPolicy.FIFO
    reuse: int = Field(default=1, ge=1)  # times each finished trajectory is handed to the learner
    priority_eps: float = Field(default=0.01, gt=0)
    lag_decay: float = Field(default=0.5, gt=0, le=1)
    seed: int = 0

    filter_uniform_reward_groups: bool = False  # DAPO dynamic sampling: drop all-equal-reward groups
    admission: AdmissionRule = AdmissionRule.BOUND
    admission_window: int = Field(default=16, gt=0)  # "expected": settled groups the kept share is read over
    min_finished_per_group: int = Field(default=1, ge=1)  # groups with fewer finished members are dropped
    # A group older than max_staleness when sampled (it started early and finished late: long
    # trajectories). "train" (default) keeps them in the data; dropping them biases towards short ones.
    over_age: OverAgePolicy = OverAgePolicy.TRAIN
    capacity_rows: int | None = Field(default=None, gt=0)  # live rows before appends are backpressured

    flush_every_rows: int = Field(default=256, gt=0)
    flush_every_ms: float = Field(default=1000.0, gt=0)
    fsync_on_checkpoint: bool = True
    fsync_durable_appends: bool = True
    segment_max_bytes: int = Field(default=256 * 1024 * 1024, gt=0)  # roll to a new segment file after
    coalesce_below_rows: int = Field(default=64, ge=1)  # merge small appended batches at flush
    compact_below_live_fraction: float = Field(default=0.75, gt=0, le=1)  # rewrite chunks below this

    @model_validator(mode="after")
    def _check(self) -> BufferConfig:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size}): "
                "batches are made of whole GRPO groups"
            )
        if self.min_finished_per_group > self.group_size:
            raise ValueError("min_finished_per_group cannot exceed group_size")
        if self.capacity_rows is not None:
            self._check_capacity(self.capacity_rows)
        return self

    def _check_capacity(self, capacity_rows: int) -> None:
        need = self.batch_size + self.group_size
        if capacity_rows < need:
            raise ValueError(
                f"buffer.capacity_rows ({capacity_rows}) must be at least buffer.batch_size + "
                f"buffer.group_size ({self.batch_size} + {self.group_size} = {need}): one batch waiting to be "
                "sampled plus one group in flight; below that the buffer fills with rows that never make a "
                "batch and admission stops for good"
            )
        if self.over_age is OverAgePolicy.KEEP:
            raise ValueError(
                'buffer.capacity_rows cannot be combined with buffer.over_age = "keep": kept over-age rows '
                "never leave, so the buffer fills and admission stops; unset one of them"
            )

    @property
    def groups_per_batch(self) -> int:
        """batch_size // group_size."""
        return self.batch_size // self.group_size
