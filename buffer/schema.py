"""The one Arrow schema of a buffer row, mirroring `rollout.types.Trajectory` field for field.

Every trajectory row that enters the buffer (finished, partial or failed) is a row of
`TRAJECTORY_SCHEMA`: the in-memory store keeps record batches of it, the durable log writes them as
Arrow IPC, export writes them as Parquet. Per-token arrays are list columns (token ids int32, mask
int8, behavior logprobs float32, per-token policy_version int32); the AgentData snapshot of partial
rows is a JSON string column.

Two image columns follow the record's fields (`IMAGE_FIELDS`): `image_refs` (sha256 hex of each
image, placeholder order) and `num_image_tokens` (placeholder tokens of each image), both
`[num_images]` and empty for text-only rows. The encoded bytes are not in the row: they live in the
buffer's image log (`buffer/images.py`). They are the last two fields of `rollout.types.Trajectory`.

`attempt` (int32, the last field before the image columns) is the row's fencing number: 0 for a
trajectory's first submission, +1 each time the driver resubmits it after its worker died. The buffer
refuses rows of an attempt older than the newest it holds for their trajectory (`buffer.groups`).

`token_side` (after `attempt`) is the row's per-token side data (`engines.token_side.TokenSide`: the
routed experts of an MoE engine), a nullable struct of kind, dtype, per-token shape and the rows as
bytes; null for a dense model's rows. It has at most one row per prompt + response token.

`teacher_logprobs` (after `token_side`) is the distillation teacher's log-prob of every response
token (`rollout.teacher`), float32, 0 at observation tokens; null for a row the teacher did not score
(no teacher in the run, a partial or failed row).

Schema versions: "1" had no image columns, "2" no `attempt` column, "3" no `token_side` column, "4"
no `teacher_logprobs` column. A segment written under any of them is read with its schema
(`LEGACY_SCHEMAS`) and `normalize_batch` adds what is missing: empty image columns, attempt 0 (before
attempts existed every row was its trajectory's first attempt, as far as anything recorded says), a
null `token_side` and null `teacher_logprobs`.

Four derived columns follow the record's fields (`DERIVED_FIELDS`): prompt/response token counts and
the min/max policy_version of the row. They are always recomputed here from the list columns
(`normalize_batch`), never trusted from the caller.

The contract is checked once, at the producer (`trajectories_to_batch` / `normalize_batch`): the
batch it returns carries a validation stamp in its schema metadata (`VALIDATED_KEY`), a crc32 over
the bytes the contract depends on (token-list offsets, mask / logprob / policy_version values,
status and finish_reason, derived columns). `normalize_batch` on a stamped batch only recomputes
that crc (about a tenth of a full check) and returns the batch as is; a batch whose stamped bytes
changed (`set_column`, a slice, a foreign producer) is fully checked again. The stamp guards against
bugs, not adversaries, and survives pickling / the Ray object store / `take`.

Round-trip contract: `batch_to_trajectories(trajectories_to_batch(ts)) == ts` for every field except
`behavior_logprobs`, which is stored as float32 (the engine produces float32 logprobs): the round-trip
returns the float32-rounded values, so a record whose logprobs are float32-representable round-trips
exactly, and Arrow -> record -> Arrow is always bit-identical.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
import zlib

import numpy as np
import pyarrow as pa

from streamrl.buffer import arrow_compute as pc
from streamrl.engines.token_side import SideKind
from streamrl.rollout.types import OBSERVATION_VERSION, FinishReason, Trajectory, TrajectoryStatus

SCHEMA_VERSION = "5"
TOKEN_SIDE_TYPE = pa.struct(
    [
        pa.field("kind", pa.string(), nullable=False),  # SideKind value
        pa.field("dtype", pa.string(), nullable=False),  # "uint8" | "int16"
        pa.field("shape", pa.list_(pa.int32()), nullable=False),  # per-token row shape
        pa.field("data", pa.large_binary(), nullable=False),  # [num_tokens, *shape] C-order
    ]
)

# name -> (arrow type, numpy dtype of the list values) for the per-token and per-turn list columns.
_LIST_COLUMNS: dict[str, tuple[pa.DataType, type]] = {
    "prompt_ids": (pa.int32(), np.int32),
    "response_ids": (pa.int32(), np.int32),
    "response_mask": (pa.int8(), np.int8),
    "behavior_logprobs": (pa.float32(), np.float32),
    "policy_versions": (pa.int32(), np.int32),
    "turn_scores": (pa.float64(), np.float64),
    "tool_rewards": (pa.float64(), np.float64),
    "num_image_tokens": (pa.int32(), np.int32),
}
TOKEN_LIST_COLUMNS = ("response_ids", "response_mask", "behavior_logprobs", "policy_versions")

RECORD_FIELDS: list[pa.Field] = [
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("agent_name", pa.string(), nullable=False),
    *(pa.field(name, pa.list_(_LIST_COLUMNS[name][0]), nullable=False) for name in ("prompt_ids", *TOKEN_LIST_COLUMNS)),
    pa.field("reward", pa.float64(), nullable=False),
    pa.field("turn_scores", pa.list_(pa.float64()), nullable=False),
    pa.field("tool_rewards", pa.list_(pa.float64()), nullable=False),
    pa.field("num_turns", pa.int32(), nullable=False),
    pa.field("num_tool_calls", pa.int32(), nullable=False),
    pa.field("num_tool_errors", pa.int32(), nullable=False),
    pa.field("status", pa.string(), nullable=False),  # TrajectoryStatus value
    pa.field("finish_reason", pa.string(), nullable=False),  # FinishReason value
    pa.field("num_interrupts", pa.int32(), nullable=False),
    pa.field("generate_s", pa.float64(), nullable=False),
    pa.field("tool_s", pa.float64(), nullable=False),
    pa.field("created_at", pa.float64(), nullable=False),
    pa.field("finished_at", pa.float64(), nullable=False),
    pa.field("agent_data_json", pa.string(), nullable=True),  # partial rows only
    pa.field("attempt", pa.int32(), nullable=False),  # fencing number (see the module docstring)
    pa.field("token_side", TOKEN_SIDE_TYPE, nullable=True),  # per-token side data; null: none (dense model)
    pa.field("teacher_logprobs", pa.list_(pa.float32()), nullable=True),  # [num_response_tokens]; null: unscored
]
DERIVED_FIELDS: list[pa.Field] = [
    pa.field("num_prompt_tokens", pa.int32(), nullable=False),
    pa.field("num_response_tokens", pa.int32(), nullable=False),
    pa.field("min_policy_version", pa.int32(), nullable=False),  # -1 if no sampled token
    pa.field("max_policy_version", pa.int32(), nullable=False),  # -1 if no response token
]
IMAGE_FIELDS: list[pa.Field] = [
    pa.field("image_refs", pa.list_(pa.string()), nullable=False),  # [num_images] sha256 hex
    pa.field("num_image_tokens", pa.list_(pa.int32()), nullable=False),  # [num_images]
]
IMAGE_FIELD_NAMES = tuple(f.name for f in IMAGE_FIELDS)
TRAJECTORY_SCHEMA = pa.schema(
    RECORD_FIELDS + IMAGE_FIELDS + DERIVED_FIELDS, metadata={"streamrl.schema": SCHEMA_VERSION}
)
_RECORD_FIELDS_V4 = [f for f in RECORD_FIELDS if f.name != "teacher_logprobs"]
TRAJECTORY_SCHEMA_V4 = pa.schema(_RECORD_FIELDS_V4 + IMAGE_FIELDS + DERIVED_FIELDS, metadata={"streamrl.schema": "4"})
_RECORD_FIELDS_V3 = [f for f in _RECORD_FIELDS_V4 if f.name != "token_side"]
TRAJECTORY_SCHEMA_V3 = pa.schema(_RECORD_FIELDS_V3 + IMAGE_FIELDS + DERIVED_FIELDS, metadata={"streamrl.schema": "3"})
_RECORD_FIELDS_V2 = [f for f in _RECORD_FIELDS_V3 if f.name != "attempt"]
TRAJECTORY_SCHEMA_V2 = pa.schema(_RECORD_FIELDS_V2 + IMAGE_FIELDS + DERIVED_FIELDS, metadata={"streamrl.schema": "2"})
TRAJECTORY_SCHEMA_V1 = pa.schema(_RECORD_FIELDS_V2 + DERIVED_FIELDS, metadata={"streamrl.schema": "1"})
LEGACY_SCHEMAS = (
    TRAJECTORY_SCHEMA_V4,
    TRAJECTORY_SCHEMA_V3,
    TRAJECTORY_SCHEMA_V2,
    TRAJECTORY_SCHEMA_V1,
)  # older on-disk schemas recovery still reads
_BASE_FIELD_NAMES = tuple(f.name for f in RECORD_FIELDS)
RECORD_FIELD_NAMES = _BASE_FIELD_NAMES + IMAGE_FIELD_NAMES
VALIDATED_KEY = b"streamrl.validated"  # schema metadata: crc32 (hex) of the stamped bytes
# column -> which of its `Array.buffers()` the stamp covers (validity bitmaps are covered by the
# null counts, which are checked on every call; token ids only matter through their offsets).
_STAMPED_BUFFERS: dict[str, tuple[int, ...]] = {
    "prompt_ids": (1,),
    "response_ids": (1,),
    "response_mask": (1, 3),
    "behavior_logprobs": (1, 3),
    "policy_versions": (1, 3),
    "status": (1, 2),
    "finish_reason": (1, 2),
    "attempt": (1,),
    "image_refs": (1,),
    "num_image_tokens": (1, 3),
    **{f.name: (1,) for f in DERIVED_FIELDS},
}
_STAMPED_INDICES = [(TRAJECTORY_SCHEMA.get_field_index(name), which) for name, which in _STAMPED_BUFFERS.items()]
_NOT_NULLABLE = [i for i, f in enumerate(TRAJECTORY_SCHEMA) if not f.nullable]
_ENUMS = {"status": TrajectoryStatus, "finish_reason": FinishReason}


def _list_array(rows: list[list], value_type: pa.DataType, dtype: type) -> pa.ListArray:
    lengths = np.fromiter(map(len, rows), dtype=np.int32, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


def trajectories_to_batch(trajectories: list[Trajectory]) -> pa.RecordBatch:
    """Records -> one RecordBatch of `TRAJECTORY_SCHEMA` (column-wise, one pass per column)."""
    columns: dict[str, pa.Array] = {}
    for f in RECORD_FIELDS + IMAGE_FIELDS:
        values = [getattr(t, f.name) for t in trajectories]
        if f.name in _LIST_COLUMNS:
            columns[f.name] = _list_array(values, *_LIST_COLUMNS[f.name])
        elif f.name == "image_refs":
            columns[f.name] = pa.array([list(v) for v in values], type=f.type)
        elif f.name in _ENUMS:
            columns[f.name] = pa.array([_ENUMS[f.name](v).value for v in values], type=pa.string())
        elif f.name == "token_side":
            columns[f.name] = pa.array([None if v is None else v.model_dump() for v in values], type=f.type)
        elif f.name == "teacher_logprobs":
            columns[f.name] = pa.array([None if v is None else np.asarray(v, np.float32) for v in values], f.type)
        else:
            columns[f.name] = pa.array(values, type=f.type)
    if not trajectories:
        return _empty_batch()
    return normalize_batch(pa.RecordBatch.from_pydict(columns))


def batch_to_trajectories(data: pa.RecordBatch | pa.Table) -> list[Trajectory]:
    """Rows -> records (analysis, resume and tests; not the learner's hot path)."""
    cols = {name: data.column(name).to_pylist() for name in RECORD_FIELD_NAMES}
    out = []
    for i in range(data.num_rows):
        row = {name: cols[name][i] for name in RECORD_FIELD_NAMES}
        out.append(Trajectory.from_dict(row))
    return out


def list_row_starts(arr: pa.ListArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, starts, lengths) of a list array with slicing accounted for: row i is
    `values[starts[i] : starts[i] + lengths[i]]`."""
    lengths = list_lengths(arr)
    starts = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    values = arr.flatten().to_numpy(zero_copy_only=False)
    return values, starts, lengths


def list_lengths(arr: pa.ListArray) -> np.ndarray:
    """int64 length of every row, from the offsets buffer (slicing accounted for)."""
    return np.diff(arr.offsets.to_numpy()).astype(np.int64)


def _per_row_reduce(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
    """Per-row ufunc reduction over list rows; empty rows give -1."""
    out = np.full(len(lengths), OBSERVATION_VERSION, dtype=np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        out[nonempty] = ufunc.reduceat(values, starts[nonempty])
    return out


def _stamp(batch: pa.RecordBatch) -> str | None:
    """crc32 (hex) of the bytes the contract depends on; None for a batch with sliced columns
    (its buffers extend past its rows, so it is checked in full instead)."""
    crc = zlib.crc32(struct.pack("<q", batch.num_rows))
    for index, which in _STAMPED_INDICES:
        col = batch.column(index)
        if col.offset:
            return None
        buffers = col.buffers()
        for i in which:
            if buffers[i] is not None:
                crc = zlib.crc32(buffers[i], crc)
    return f"{crc:08x}"


def is_validated(batch: pa.RecordBatch) -> bool:
    """Whether `batch` is in `TRAJECTORY_SCHEMA` and carries a stamp matching its bytes."""
    meta = batch.schema.metadata
    stamp = meta.get(VALIDATED_KEY) if meta else None
    if stamp is None or not batch.schema.equals(TRAJECTORY_SCHEMA):
        return False
    if any(batch.column(i).null_count for i in _NOT_NULLABLE):
        return False
    return _stamp(batch) == stamp.decode()


def normalize_batch(data: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
    """Validate a batch against the data contract and return it in `TRAJECTORY_SCHEMA` with derived
    columns recomputed and a validation stamp. A batch whose stamp matches is returned as is.
    Raises ValueError naming the offending column / trajectory."""
    if isinstance(data, pa.Table):
        data = data.combine_chunks().to_batches()[0] if data.num_rows else _empty_batch()
    if is_validated(data):
        return data
    data = _with_added_columns(data)
    missing = [n for n in RECORD_FIELD_NAMES if n not in data.schema.names]
    if missing:
        raise ValueError(f"batch is missing trajectory columns {missing}; build it with trajectories_to_batch")
    arrays: list[pa.Array] = []
    for f in RECORD_FIELDS + IMAGE_FIELDS:
        col = data.column(f.name)
        if not col.type.equals(f.type):
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValueError(f"column {f.name!r} has type {col.type}, expected {f.type}: {e}") from e
        if not f.nullable and col.null_count:
            raise ValueError(f"column {f.name!r} has {col.null_count} nulls; it is not nullable")
        arrays.append(col)
    cols = dict(zip(RECORD_FIELD_NAMES, arrays))
    _check_enums(cols)
    _check_images(cols)
    _check_token_side(cols)
    _check_teacher(cols)
    if len(cols["attempt"]) and pc.min(cols["attempt"]).as_py() < 0:
        raise ValueError("column 'attempt' must be >= 0 (0 for a trajectory's first submission)")
    ids = cols["trajectory_id"]
    lengths = [list_lengths(cols[n]) for n in TOKEN_LIST_COLUMNS]
    bad = np.flatnonzero(np.any(np.stack(lengths) != lengths[0], axis=0)) if len(ids) else []
    if len(bad):
        raise ValueError(f"per-token arrays misaligned in trajectory {ids[int(bad[0])].as_py()!r}")
    versions, starts, lens = list_row_starts(cols["policy_versions"])
    mask = cols["response_mask"].flatten().to_numpy(zero_copy_only=False)
    logprobs = cols["behavior_logprobs"].flatten().to_numpy(zero_copy_only=False)
    sampled = versions >= 0
    valid = len(mask) == 0 or (
        int(mask.min()) >= 0
        and int(mask.max()) <= 1
        and int(versions.min()) >= OBSERVATION_VERSION
        and np.array_equal(sampled, mask.view(np.bool_))
        and not np.any(logprobs * ~sampled)
    )
    if not valid:
        broken = ~(((mask == 1) & sampled) | ((mask == 0) & (versions == OBSERVATION_VERSION) & (logprobs == 0)))
        row = int(np.searchsorted(starts, np.flatnonzero(broken)[0], side="right") - 1)
        raise ValueError(
            f"trajectory {ids[row].as_py()!r}: response_mask must be 0/1, sampled tokens need a "
            "policy_version >= 0, observation tokens need policy_version -1 and logprob 0"
        )
    min_v = _per_row_reduce(np.where(sampled, versions, np.iinfo(np.int32).max), starts, lens, np.minimum)
    min_v[min_v == np.iinfo(np.int32).max] = OBSERVATION_VERSION
    max_v = _per_row_reduce(versions, starts, lens, np.maximum)
    derived = [
        pa.array(list_lengths(cols["prompt_ids"]).astype(np.int32)),
        pa.array(lens.astype(np.int32)),
        pa.array(min_v.astype(np.int32)),
        pa.array(max_v.astype(np.int32)),
    ]
    batch = pa.RecordBatch.from_arrays(arrays + derived, schema=TRAJECTORY_SCHEMA)
    stamp = _stamp(batch)
    if stamp is None:
        return batch
    return batch.replace_schema_metadata({**TRAJECTORY_SCHEMA.metadata, VALIDATED_KEY: stamp})


def _with_added_columns(data: pa.RecordBatch) -> pa.RecordBatch:
    """Columns added since schema "1" that an older batch lacks (a legacy segment on disk, a producer
    predating them): `attempt` 0 and empty image columns."""
    if "attempt" not in data.schema.names:
        data = data.append_column(TRAJECTORY_SCHEMA.field("attempt"), pa.array(np.zeros(data.num_rows, np.int32)))
    if "token_side" not in data.schema.names:
        data = data.append_column(TRAJECTORY_SCHEMA.field("token_side"), pa.nulls(data.num_rows, TOKEN_SIDE_TYPE))
    if "teacher_logprobs" not in data.schema.names:
        field = TRAJECTORY_SCHEMA.field("teacher_logprobs")
        data = data.append_column(field, pa.nulls(data.num_rows, field.type))
    for f in IMAGE_FIELDS:
        if f.name not in data.schema.names:
            empty = pa.ListArray.from_arrays(
                pa.array(np.zeros(data.num_rows + 1, dtype=np.int32)), pa.array([], f.type.value_type)
            )
            data = data.append_column(f, empty)
    return data


def _check_images(cols: dict[str, pa.Array]) -> None:
    refs, counts = cols["image_refs"], cols["num_image_tokens"]
    bad = np.flatnonzero(list_lengths(refs) != list_lengths(counts))
    if len(bad):
        tid = cols["trajectory_id"][int(bad[0])].as_py()
        raise ValueError(f"trajectory {tid!r}: image_refs and num_image_tokens differ in length")
    flat = refs.flatten()
    if len(flat) and (flat.null_count or not pc.all(pc.match_substring_regex(flat, r"^[0-9a-f]{64}$")).as_py()):
        raise ValueError("image_refs must be sha256 hex digests (64 lowercase hex characters)")
    tokens = counts.flatten().to_numpy(zero_copy_only=False)
    if len(tokens) and int(tokens.min()) <= 0:
        raise ValueError("num_image_tokens must be > 0 for every image")


def _check_token_side(cols: dict[str, pa.Array]) -> None:
    """Each non-null row: a known kind and dtype, whole rows of its shape, none past the sequence."""
    side = cols["token_side"]
    if side.null_count == len(side):
        return
    seq_lens = list_lengths(cols["prompt_ids"]) + list_lengths(cols["response_ids"])
    for i, value in enumerate(side.to_pylist()):
        if value is None:
            continue
        tid = cols["trajectory_id"][i].as_py()
        if value["kind"] not in {k.value for k in SideKind} or value["dtype"] not in ("uint8", "int16"):
            raise ValueError(f"trajectory {tid!r}: token_side of unknown kind/dtype {value['kind']}/{value['dtype']}")
        row = int(np.prod(value["shape"])) * np.dtype(value["dtype"]).itemsize
        if row <= 0 or len(value["data"]) % row or len(value["data"]) // row > seq_lens[i]:
            raise ValueError(
                f"trajectory {tid!r}: token_side holds {len(value['data'])} bytes, not whole rows of {row} bytes "
                f"for at most {seq_lens[i]} tokens"
            )


def _check_teacher(cols: dict[str, pa.Array]) -> None:
    """Each non-null `teacher_logprobs` row: one finite value per response token, 0 at observation tokens."""
    teacher = cols["teacher_logprobs"]
    if teacher.null_count == len(teacher):
        return
    scored = np.asarray(teacher.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    response_lens = list_lengths(cols["response_ids"])
    bad = np.flatnonzero(scored & (list_lengths(teacher) != response_lens))
    if not len(bad):
        values = teacher.flatten().to_numpy(zero_copy_only=False)  # the scored rows' values, in row order
        in_scored = np.repeat(scored, response_lens)
        mask = cols["response_mask"].flatten().to_numpy(zero_copy_only=False)[in_scored]
        wrong = np.where(mask == 1, ~np.isfinite(values), values != 0)
        bad = np.repeat(np.arange(len(scored)), response_lens)[in_scored][wrong]
    if len(bad):
        tid = cols["trajectory_id"][int(bad[0])].as_py()
        raise ValueError(
            f"trajectory {tid!r}: teacher_logprobs needs one finite value per response token, 0 at observation tokens"
        )


def _check_enums(cols: dict[str, pa.Array]) -> None:
    for name, enum in _ENUMS.items():
        allowed = {e.value for e in enum}
        unknown = set(pc.unique(cols[name]).to_pylist()) - allowed
        if unknown:
            raise ValueError(f"column {name!r} has unknown values {sorted(unknown)}; allowed {sorted(allowed)}")


def _empty_batch() -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in TRAJECTORY_SCHEMA], schema=TRAJECTORY_SCHEMA)


def record_field_names() -> tuple[str, ...]:
    """The Trajectory dataclass fields, for the schema-mirror test."""
    return tuple(f.name for f in dataclasses.fields(Trajectory))


def image_refs_of(data: pa.RecordBatch | pa.Table) -> list[list[str]]:
    """`image_refs` of every row (`[B][num_images]`)."""
    return data.column("image_refs").to_pylist()
