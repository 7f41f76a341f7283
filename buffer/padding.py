"""Arrow rows -> right-padded numpy arrays for the learner, without per-row Python loops.

Each list column is read once as (flat values, row starts, row lengths) straight from Arrow's list
offsets; tokens are scattered into the [B, T] arrays with one fancy-index assignment per column.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from streamrl.buffer import arrow_compute as pc
from streamrl.buffer.schema import list_row_starts
from streamrl.buffer.types import PaddedBatch
from streamrl.engines.token_side import SideKind, TokenSide, padded_side
from streamrl.rollout.types import OBSERVATION_VERSION


def _positions(starts: np.ndarray, lengths: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of every flat list value, with row b's values placed from column shift[b]."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    total = int(lengths.sum())
    cols = np.arange(total, dtype=np.int64) - np.repeat(starts - shift, lengths)
    return rows, cols


def pad_table(table: pa.Table | pa.RecordBatch, *, images: list[list[bytes]] | None = None) -> PaddedBatch:
    """Right-pad prompt + response of every row into [B, T] arrays (T = longest sequence).

    `images` (`[B][num_images]` encoded bytes, from the buffer's image log) become `PaddedBatch.images`
    after a check that each row has one per `image_refs` entry; rows with images and no bytes raise."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    table = table.combine_chunks()
    col = lambda name: table.column(name).chunk(0) if table.num_rows else pa.array([], table.schema.field(name).type)  # noqa: E731
    batch_size = table.num_rows
    p_vals, p_starts, p_lens = list_row_starts(col("prompt_ids"))
    r_ids, r_starts, r_lens = list_row_starts(col("response_ids"))
    seq_lens = p_lens + r_lens
    width = int(seq_lens.max()) if batch_size else 0

    input_ids = np.zeros((batch_size, width), dtype=np.int64)
    loss_mask = np.zeros((batch_size, width), dtype=np.int8)
    logprobs = np.zeros((batch_size, width), dtype=np.float32)
    versions = np.full((batch_size, width), OBSERVATION_VERSION, dtype=np.int32)

    rows, cols = _positions(p_starts, p_lens, np.zeros_like(p_lens))
    input_ids[rows, cols] = p_vals
    rows, cols = _positions(r_starts, r_lens, p_lens)
    input_ids[rows, cols] = r_ids
    loss_mask[rows, cols] = col("response_mask").flatten().to_numpy(zero_copy_only=False)
    logprobs[rows, cols] = col("behavior_logprobs").flatten().to_numpy(zero_copy_only=False)
    versions[rows, cols] = col("policy_versions").flatten().to_numpy(zero_copy_only=False)
    attention_mask = (np.arange(width)[None, :] < seq_lens[:, None]).astype(np.int8)

    refs = (
        table.column("image_refs").to_pylist()
        if "image_refs" in table.schema.names
        else [[] for _ in range(batch_size)]
    )
    if images is None and any(refs):
        raise ValueError("rows reference images but no image bytes were given (sample through the buffer)")
    if images is not None and (len(images) != batch_size or [len(r) for r in images] != [len(r) for r in refs]):
        raise ValueError("images do not match the rows' image_refs ([B][num_images])")

    group_col = table.column("group_id")
    group_index = pc.dictionary_encode(group_col).combine_chunks().indices if batch_size else pa.array([], pa.int32())
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behavior_logprobs=logprobs,
        policy_versions=versions,
        prompt_lens=p_lens.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        rewards=table.column("reward").to_numpy().astype(np.float32),
        group_index=np.asarray(group_index.to_numpy(zero_copy_only=False), dtype=np.int64),
        trajectory_ids=table.column("trajectory_id").to_pylist(),
        group_ids=group_col.to_pylist(),
        turn_scores=table.column("turn_scores").to_pylist(),
        images=images if any(refs) else None,
        routed_experts=_padded_routes(table, width),
        teacher_logprobs=_padded_teacher(table, p_lens, width),
    )


def _padded_teacher(table: pa.Table, prompt_lens: np.ndarray, width: int) -> np.ndarray | None:
    """[B, T] float32 teacher log-probs at the response positions of the rows the teacher scored, NaN
    elsewhere (prompt, padding, unscored rows); None when no row was scored."""
    if "teacher_logprobs" not in table.schema.names or table.column("teacher_logprobs").null_count == table.num_rows:
        return None
    column = table.column("teacher_logprobs").chunk(0)
    values, starts, lengths = list_row_starts(column)  # null rows: length 0 in the flattened values
    lengths = np.where(np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool), lengths, 0)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    out = np.full((table.num_rows, width), np.nan, dtype=np.float32)
    rows, cols = _positions(starts, lengths, prompt_lens)
    out[rows, cols] = values
    return out


def _padded_routes(table: pa.Table, width: int) -> np.ndarray | None:
    """[B, T, L, K] int16 routes of the rows' `token_side` (-1: none), None when no row has routes."""
    if "token_side" not in table.schema.names or table.column("token_side").null_count == table.num_rows:
        return None
    sides = [None if v is None else TokenSide.model_validate(v) for v in table.column("token_side").to_pylist()]
    return padded_side([s if s is not None and s.kind is SideKind.ROUTED_EXPERTS else None for s in sides], width)
