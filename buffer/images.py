"""`ImageLog`: the buffer's write-once store of encoded image bytes, keyed by sha256.

Trajectory rows reference images by hash (`image_refs`); the bytes live here, once per hash, so a
GRPO group of 8 samples of one image prompt stores its image once. With a buffer directory the
images are a third durable log next to `traj` and `consumed` (prefix `images`, the same segment +
index + crc format and recovery path, `buffer/log.py`), one row per image in `IMAGE_SCHEMA`.

Ordering: `ReplayBuffer.append` writes (and flushes to the OS) the new images of a call *before* it
hands the trajectory frame that references them to the trajectory log's writer thread, so a row that
survives a kill never points at an image that did not. Recovery reads this log first and rebuilds
the set of written hashes.

The bytes are also kept in memory (`get` serves batch building without disk reads); images are
never dropped (no eviction yet: one image is tens of KB, the bytes of a few thousand trajectories).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from streamrl.buffer.log import SegmentWriter, read_segments
from streamrl.buffer.types import ImageBlob, RecoveryReport

logger = logging.getLogger(__name__)

IMAGES_PREFIX = "images"
IMAGE_SCHEMA = pa.schema(
    [
        pa.field("sha256", pa.string(), nullable=False),
        pa.field("mime", pa.string(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("data", pa.binary(), nullable=False),  # encoded bytes
    ]
)


class ImageLog:
    """sha256 -> encoded bytes; durable when given a directory. Not thread-safe (the buffer's caller
    serializes calls)."""

    def __init__(self, root: Path | None, *, segment_max_bytes: int) -> None:
        self._root = root
        self._data: dict[str, bytes] = {}
        self._writer: SegmentWriter | None = None
        self._segment_max_bytes = segment_max_bytes
        self.recovered_segments: list[dict] = []  # manifest entries of segments written before this open
        self._unresolved: set[str] = set()  # refs of recovered rows whose bytes were not recovered

    def __contains__(self, sha256: str) -> bool:
        return sha256 in self._data

    def __len__(self) -> int:
        return len(self._data)

    @property
    def segments(self) -> list[dict]:
        """Manifest entries: recovered segments, then this process's."""
        current = [{"name": s.name, "num_frames": s.num_frames} for s in self._writer.segments] if self._writer else []
        return self.recovered_segments + current

    @property
    def error(self) -> OSError | None:
        """The I/O error that failed the image log's writer, if any (`buffer.log.LogFailedError`)."""
        return self._writer.error if self._writer else None

    @property
    def num_segments_written(self) -> int:
        return len(self._writer.segments) if self._writer else 0

    def recover(self, report: RecoveryReport, expected: dict[str, int]) -> None:
        """Read every verified frame of the directory's image log; a torn or corrupt frame's images
        are simply absent (reported by `read_segments`)."""
        assert self._root is not None and self._writer is None, "recover once, before writing"
        seen: dict[str, int] = {}
        for name, batch in read_segments(
            self._root, prefix=IMAGES_PREFIX, schema=IMAGE_SCHEMA, report=report, expected=expected
        ):
            seen[name] = seen.get(name, 0) + 1
            for sha, data in zip(batch.column("sha256").to_pylist(), batch.column("data").to_pylist()):
                self._data.setdefault(sha, data)
        report.num_images = len(self._data)
        self.recovered_segments = [{"name": n, "num_frames": k} for n, k in seen.items()]

    def note_refs(self, refs: list[list[str]]) -> None:
        """Recovery: remember the refs of recovered rows that the image log does not hold."""
        self._unresolved.update(self.missing(r for row in refs for r in row))

    def report_unresolved(self, report: RecoveryReport) -> None:
        if self._unresolved:
            msg = (
                f"{len(self._unresolved)} images referenced by recovered rows are not in the image log; "
                "their groups are dropped when sampled"
            )
            report.missing.append(msg)
            logger.warning("buffer recovery: %s", msg)

    def missing(self, refs: Iterable[str]) -> list[str]:
        """The refs (deduplicated, in order) that are not stored."""
        return [r for r in dict.fromkeys(refs) if r not in self._data]

    def check_refs(self, refs: list[list[str]], trajectory_ids: list[str], blobs: list[ImageBlob]) -> None:
        """ValueError if a row's ref (`refs[i]` of trajectory `trajectory_ids[i]`) is neither stored
        nor among `blobs`: the append that brought them is refused before anything is written."""
        supplied = {b.sha256 for b in blobs}
        missing = [r for r in self.missing(r for row in refs for r in row) if r not in supplied]
        if missing:
            rows = [tid for tid, row in zip(trajectory_ids, refs) if set(row) & set(missing)]
            raise ValueError(
                f"append refused: {len(missing)} image(s) referenced but neither in the buffer nor supplied "
                f"(first {missing[0]}, trajectories {rows[:3]}); pass their bytes in `images=`"
            )

    def put(self, images: Iterable[ImageBlob]) -> int:
        """Store the images not stored yet, as one frame flushed to the OS before returning (write-once
        by hash: a known hash is skipped). Raises ValueError, writing nothing, if any blob's bytes do
        not hash to its sha256. Returns the number of new images."""
        new: dict[str, ImageBlob] = {}
        for blob in images:
            if blob.sha256 in self._data or blob.sha256 in new:
                continue
            digest = hashlib.sha256(blob.data).hexdigest()
            if digest != blob.sha256:
                raise ValueError(f"image bytes hash to {digest}, not to their sha256 {blob.sha256}")
            new[blob.sha256] = blob
        if not new:
            return 0
        if (root := self._root) is not None:
            blobs = list(new.values())
            frame = pa.RecordBatch.from_arrays(
                [
                    pa.array([b.sha256 for b in blobs], pa.string()),
                    pa.array([b.mime for b in blobs], pa.string()),
                    pa.array([b.width for b in blobs], pa.int32()),
                    pa.array([b.height for b in blobs], pa.int32()),
                    pa.array([b.data for b in blobs], pa.binary()),
                ],
                schema=IMAGE_SCHEMA,
            )
            self._writer_open(root).write(frame)  # in this thread: flushed before the caller goes on
        for sha, blob in new.items():
            self._data[sha] = blob.data
        return len(new)

    def get(self, sha256: str) -> bytes:
        try:
            return self._data[sha256]
        except KeyError:
            raise KeyError(f"image {sha256} is not in the buffer's image log") from None

    def rows(self, refs: list[list[str]]) -> list[list[bytes]] | None:
        """`[B][num_images]` bytes for rows of refs; None when no row has an image."""
        if not any(refs):
            return None
        return [[self.get(r) for r in row] for row in refs]

    def _writer_open(self, root: Path) -> SegmentWriter:
        if self._writer is None:
            self._writer = SegmentWriter(
                root, prefix=IMAGES_PREFIX, schema=IMAGE_SCHEMA, segment_max_bytes=self._segment_max_bytes
            )
        return self._writer

    def sync(self) -> None:
        if self._writer is not None:
            self._writer.sync()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._data.values())
