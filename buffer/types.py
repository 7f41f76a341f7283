"""Typed records that leave the buffer: a sampled batch, its padded numpy form, a recovery report.

`PaddedBatch` is the learner's input: one right-padded row per trajectory holding the full sequence
(prompt tokens then response tokens). Invariants, for row b with P = prompt_lens[b] and
S = seq_lens[b]:
- positions [0, S) hold tokens (attention_mask 1), positions [S, T) are padding (everything 0,
  policy_versions -1);
- loss_mask is 1 exactly at response positions whose token was sampled by the policy
  (response_mask 1); behavior_logprobs is 0 and policy_versions -1 wherever loss_mask is 0;
- group_index[b] is the dense index of group_ids[b] within the batch, in order of first appearance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa


@dataclass(kw_only=True, slots=True)
class PaddedBatch:
    input_ids: np.ndarray  # int64 [B, T]
    attention_mask: np.ndarray  # int8 [B, T]
    loss_mask: np.ndarray  # int8 [B, T]
    behavior_logprobs: np.ndarray  # float32 [B, T]
    policy_versions: np.ndarray  # int32 [B, T]
    prompt_lens: np.ndarray  # int32 [B]
    seq_lens: np.ndarray  # int32 [B]
    rewards: np.ndarray  # float32 [B]
    group_index: np.ndarray  # int64 [B]
    trajectory_ids: list[str]  # [B]
    group_ids: list[str]  # [B]
    turn_scores: list[list[float]]  # [B][num_scored_turns]
    images: list[list[bytes]] | None = None  # [B][num_images] encoded bytes, placeholder order; None: no row has images
    # int16 [B, T, num_moe_layers, top_k] experts each token was routed through when generated, -1 where
    # unknown (routed live); None: no row has routes (a dense model)
    routed_experts: np.ndarray | None = None
    # float32 [B, T] the distillation teacher's log-prob of each response token, NaN where the teacher
    # scored nothing (prompt, padding, an unscored row); None: no row was scored
    teacher_logprobs: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens.sum())


@dataclass(kw_only=True, slots=True)
class SampledBatch:
    """Whole GRPO groups handed to the learner at one step; their consumption is already recorded.

    `table` rows are ordered group by group (sample_index order inside a group)."""

    table: pa.Table  # TRAJECTORY_SCHEMA rows, [B]
    trajectory_ids: list[str]  # [B]
    learner_step: int
    served_version: int
    lags: np.ndarray  # int64 [B]: served_version - min_policy_version of each row
    images: list[list[bytes]] | None = None  # [B][num_images], from the image log; None: no row has images

    @property
    def num_trajectories(self) -> int:
        return self.table.num_rows

    def to_padded(self) -> PaddedBatch:
        from streamrl.buffer.padding import pad_table

        return pad_table(self.table, images=self.images)


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageBlob:
    """One image's encoded bytes handed to `ReplayBuffer.append(..., images=)`: the fields of
    `rollout.types.ImageRef` plus the bytes. `data` must hash to `sha256` (checked on write)."""

    sha256: str
    mime: str
    width: int
    height: int
    data: bytes  # encoded (PNG) bytes

    @classmethod
    def from_ref(cls, ref, data: bytes) -> ImageBlob:  # ref: rollout.types.ImageRef
        return cls(sha256=ref.sha256, mime=ref.mime, width=ref.width, height=ref.height, data=data)


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferProgress:
    """What the driver's waits read: trajectories admitted and not yet accepted (every member of an
    open group), rows appended since the buffer started (grows while anything arrives; the stall
    check) and the change counter the long-poll waits on."""

    in_flight: int
    rows_appended: int
    changes: int = 0  # `ReplayBuffer.num_changes`: pass it back to `wait_progress` to wait for the next one


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupOutcome:
    """The rewards of one settled group (it left OPEN: ready, filtered, dropped, ...). Its failed
    members are left out: a failure says nothing about how hard the prompt is."""

    group_id: str
    rewards: tuple[float, ...]  # [num_finished] the finished members' rewards, sample_index order


@dataclass(frozen=True, kw_only=True, slots=True)
class SettledGroups:
    """`ReplayBuffer.settled_groups`: the outcomes of the groups settled since the `start`-th one, in
    settle order (a recovered buffer settles its groups again, in log order). Read from 0 on a fresh
    reader, it is every settled group of the run, so whatever is derived from it survives a restart."""

    outcomes: list[GroupOutcome]  # [num_settled_since_start]
    next_start: int  # pass back as `start` to read only the groups settled after these
    num_in_flight: int  # trajectories of open groups when read: 0 = no outcome is still to come


@dataclass(kw_only=True, slots=True)
class RecoveryReport:
    """What recovery found in a buffer directory; every problem has a human-readable line."""

    num_segments: int = 0
    num_frames: int = 0
    num_rows: int = 0
    num_consumption_records: int = 0
    num_images: int = 0
    torn_tails: list[str] = field(default_factory=list)  # incomplete writes at a segment's end
    corrupt: list[str] = field(default_factory=list)  # checksum mismatches / unreadable frames
    missing: list[str] = field(default_factory=list)  # segments listed in the manifest but absent

    @property
    def clean(self) -> bool:
        return not (self.torn_tails or self.corrupt or self.missing)

    def lines(self) -> list[str]:
        head = (
            f"recovered {self.num_rows} rows from {self.num_frames} frames in {self.num_segments} segments, "
            f"{self.num_consumption_records} consumption records"
        ) + (f", {self.num_images} images" if self.num_images else "")
        return [head, *self.torn_tails, *self.corrupt, *self.missing]
