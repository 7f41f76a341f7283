"""Per-token side data: what an engine produces beside each token, kept with the token to the learner.

One `TokenSide` holds one kind of side data for every position of a trajectory's sequence
(`prompt_ids + response_ids`), one fixed-shape row per token, as compact C-order bytes. It travels
in `GenerationOutput` (the positions one engine request forwarded), in `AgentData` (parked and
resumed with the trajectory's tokens), in `Trajectory` and in the buffer's `token_side` column, and
reaches the learner as a padded [B, T, ...] array.

The first kind is `ROUTED_EXPERTS`: row t is the [num_moe_layers, top_k] experts the engine routed
token t through when it first forwarded it (the token as input, so the last sampled token, never fed
back, has no row yet). The learner replays them (`learner.moe_replay`). A row the engine did not
produce — a prefix-cache hit whose routes were no longer kept, a position past the rows — is the
kind's fill value (every entry `missing_value(dtype)`) and the learner routes that token live.

Merging keeps the first row recorded for a position (`merge_first`): a resumed generation
re-prefills the trajectory under the new weights, and those re-prefill routes must not overwrite
the routes its tokens were sampled with.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

SideDtype = Literal["uint8", "int16"]


class SideKind(StrEnum):
    ROUTED_EXPERTS = "routed_experts"  # [num_moe_layers, top_k] expert ids per token


def missing_value(dtype: SideDtype) -> int:
    """The fill of a missing row: 255 for uint8 (expert ids < 255), -1 for int16."""
    return 255 if dtype == "uint8" else -1


def route_dtype(num_experts: int) -> SideDtype:
    """The narrowest dtype that holds every expert id and the fill value."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")
    return "uint8" if num_experts < 255 else "int16"


class TokenSide(BaseModel):
    """`num_tokens` rows of `shape`, dtype `dtype`, as C-order bytes (base64 in JSON)."""

    model_config = ConfigDict(frozen=True, ser_json_bytes="base64", val_json_bytes="base64")

    kind: SideKind
    dtype: SideDtype
    shape: tuple[int, ...] = Field(description="per-token row shape, e.g. (num_moe_layers, top_k)")
    data: bytes  # [num_tokens, *shape]

    @model_validator(mode="after")
    def _check(self) -> TokenSide:
        if any(d <= 0 for d in self.shape):
            raise ValueError(f"token side shape must be positive, got {self.shape}")
        row = self.row_bytes
        if len(self.data) % row:
            raise ValueError(f"token side data of {len(self.data)} bytes is not whole rows of {row} bytes")
        return self

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def num_tokens(self) -> int:
        return len(self.data) // self.row_bytes

    def array(self) -> np.ndarray:  # [num_tokens, *shape], read-only view of `data`
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.num_tokens, *self.shape)

    def present(self) -> np.ndarray:  # [num_tokens] bool: rows the engine produced
        arr = self.array().reshape(self.num_tokens, -1)
        return ~(arr == missing_value(self.dtype)).all(axis=1)

    @classmethod
    def from_array(cls, kind: SideKind, rows: np.ndarray) -> TokenSide:
        """`rows` [num_tokens, *shape] of a supported integer dtype."""
        dtype = str(rows.dtype)
        if dtype not in ("uint8", "int16") or rows.ndim < 2:
            raise ValueError(f"token side rows must be [num_tokens, ...] uint8 or int16, got {rows.dtype} {rows.shape}")
        return cls(kind=kind, dtype=dtype, shape=tuple(rows.shape[1:]), data=np.ascontiguousarray(rows).tobytes())  # type: ignore[arg-type]


def merge_first(old: TokenSide | None, new: TokenSide | None) -> TokenSide | None:
    """Rows of both, each position keeping the first row recorded for it: `old`'s where present, else
    `new`'s. ValueError when the two are of another kind, dtype or row shape."""
    if new is None:
        return old
    if old is None:
        return new
    if (old.kind, old.dtype, old.shape) != (new.kind, new.dtype, new.shape):
        have, got = f"{old.kind}/{old.dtype}{list(old.shape)}", f"{new.kind}/{new.dtype}{list(new.shape)}"
        raise ValueError(f"token side mismatch: have {have}, got {got}")
    size = max(old.num_tokens, new.num_tokens)
    out = np.full((size, *old.shape), missing_value(old.dtype), dtype=old.dtype)
    out[: new.num_tokens] = new.array()
    keep = np.zeros(size, dtype=bool)
    keep[: old.num_tokens] = old.present()
    out[: old.num_tokens][keep[: old.num_tokens]] = old.array()[keep[: old.num_tokens]]
    return TokenSide.from_array(old.kind, out)


def padded_side(sides: list[TokenSide | None], width: int) -> np.ndarray | None:
    """[B, width, *shape] int16 of one kind, −1 where a row has no data (a dense row, padding, a
    missing row); None when no row has side data. ValueError on rows of differing kind or shape."""
    present = [s for s in sides if s is not None]
    if not present:
        return None
    first = present[0]
    if any((s.kind, s.shape) != (first.kind, first.shape) for s in present):
        raise ValueError("token side data of one batch must share kind and row shape")
    out = np.full((len(sides), width, *first.shape), -1, dtype=np.int16)
    for b, side in enumerate(sides):
        if side is None:
            continue
        if side.num_tokens > width:
            raise ValueError(f"row {b} has token side data for {side.num_tokens} tokens, its sequence has {width}")
        rows = side.array().astype(np.int16)
        rows[~side.present()] = -1
        out[b, : side.num_tokens] = rows
    return out
