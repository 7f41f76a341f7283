"""In-memory row store: immutable Arrow record batches ("chunks") plus per-row location arrays.

Every row ever added gets a row id (0, 1, 2, ...). `chunk_of[row]` / `offset[row]` locate it and
`live[row]` says whether anyone still needs it. Appended batches are kept as-is (no copy); small ones
are coalesced into one chunk at flush; a chunk whose live fraction drops below a threshold is
rewritten with only its live rows, and a chunk with no live rows is released. Memory therefore stays
close to the bytes of the live rows. Reads are `take`s on the chunks (a copy of the selected rows
only), in the order asked for.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from streamrl.buffer.schema import TRAJECTORY_SCHEMA


class RowStore:
    def __init__(self, *, compact_below_live_fraction: float) -> None:
        self.compact_below = compact_below_live_fraction
        self.chunks: dict[int, pa.RecordBatch] = {}
        self._chunk_rows: dict[int, np.ndarray] = {}  # chunk id -> row ids in chunk order
        self._chunk_live: dict[int, int] = {}
        self._next_chunk = 0
        self.num_rows = 0
        self.num_live = 0
        self.chunk_of = np.empty(0, dtype=np.int64)
        self.offset = np.empty(0, dtype=np.int64)
        self.live = np.empty(0, dtype=bool)

    def _grow(self, need: int) -> None:
        if need <= len(self.live):
            return
        cap = max(need, 2 * len(self.live), 1024)
        for name, fill in (("chunk_of", -1), ("offset", 0), ("live", False)):
            old = getattr(self, name)
            new = np.full(cap, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _put_chunk(self, batch: pa.RecordBatch, rows: np.ndarray) -> int:
        cid = self._next_chunk
        self._next_chunk += 1
        self.chunks[cid] = batch
        self._chunk_rows[cid] = rows
        self.chunk_of[rows] = cid
        self.offset[rows] = np.arange(len(rows))
        self._chunk_live[cid] = int(self.live[rows].sum())
        return cid

    def add(self, batch: pa.RecordBatch) -> tuple[int, int]:
        """Store a batch; returns (chunk id, first row id). Its rows start live."""
        first = self.num_rows
        self._grow(first + batch.num_rows)
        rows = np.arange(first, first + batch.num_rows)
        self.live[rows] = True
        self.num_rows += batch.num_rows
        self.num_live += batch.num_rows
        return self._put_chunk(batch, rows), first

    def coalesce(self, chunk_ids: list[int]) -> pa.RecordBatch:
        """Replace chunks (in order) by one combined chunk; returns the combined batch."""
        batches = [self.chunks[c] for c in chunk_ids]
        combined = pa.Table.from_batches(batches, schema=TRAJECTORY_SCHEMA).combine_chunks().to_batches()[0]
        rows = np.concatenate([self._chunk_rows[c] for c in chunk_ids])
        for c in chunk_ids:
            self._drop_chunk(c)
        if self.live[rows].any():
            self._put_chunk(combined, rows)
        return combined

    def kill(self, rows: list[int] | np.ndarray) -> None:
        """Mark rows dead (idempotent); release or compact chunks that became mostly dead."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))  # a row listed twice dies once
        rows = rows[self.live[rows]]
        if not len(rows):
            return
        self.live[rows] = False
        self.num_live -= len(rows)
        cids, counts = np.unique(self.chunk_of[rows], return_counts=True)
        for cid, n in zip(cids.tolist(), counts.tolist()):
            self._chunk_live[cid] -= n
            if self._chunk_live[cid] == 0:
                self._drop_chunk(cid)
            elif self._chunk_live[cid] < self.compact_below * len(self._chunk_rows[cid]):
                self._compact(cid)

    def _drop_chunk(self, cid: int) -> None:
        del self.chunks[cid], self._chunk_rows[cid], self._chunk_live[cid]

    def _compact(self, cid: int) -> None:
        rows = self._chunk_rows[cid]
        keep = rows[self.live[rows]]
        batch = self.chunks[cid].take(pa.array(self.offset[keep]))
        self._drop_chunk(cid)
        self._put_chunk(batch, keep)

    def take(self, rows: np.ndarray) -> pa.Table:
        """Rows (live ones) in the given order, as one-chunk table."""
        rows = np.asarray(rows, dtype=np.int64)
        assert self.live[rows].all(), "reading dead rows"
        if not len(rows):
            return TRAJECTORY_SCHEMA.empty_table()
        cids = self.chunk_of[rows]
        order = np.argsort(cids, kind="stable")
        pieces = []
        for cid in np.unique(cids).tolist():
            sel = rows[cids == cid]
            pieces.append(self.chunks[cid].take(pa.array(self.offset[sel])))
        table = pa.Table.from_batches(pieces, schema=TRAJECTORY_SCHEMA)
        if len(pieces) == 1:
            return table
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return table.take(pa.array(inverse)).combine_chunks()

    @property
    def nbytes(self) -> int:
        """Arrow buffer bytes held plus the per-row arrays."""
        arrow = sum(b.get_total_buffer_size() for b in self.chunks.values())
        return arrow + self.chunk_of.nbytes + self.offset.nbytes + self.live.nbytes
