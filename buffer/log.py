"""Append-only, checksummed log of Arrow record batches in IPC segment files.

Layout of one log (`<prefix>` is `traj`, `consumed` or `images`) inside a buffer directory:

    <prefix>-000001.arrow   Arrow IPC *stream*: schema message, record batch messages ("frames"),
                            an end-of-stream marker once sealed. Readable by any Arrow reader.
    <prefix>-000001.idx     one fixed-size 32-byte entry per frame: offset, length, crc32 of the
                            frame bytes, row count, crc32 of the entry itself.

Write order per frame: frame bytes, then index entry, each with `os.write` (looping over short
writes; unbuffered, so written means handed to the OS). A frame counts as written ("flushed": it
survives a kill -9 of the process) once its index entry is complete; `sync()` fsyncs both files
(survives a machine crash). Writes and fsyncs go through `core.iofaults` (plain `os` calls unless a
fault plan is armed). `submit` hands a frame to the writer's one background thread (serializing,
checksumming and writing release the GIL, so they overlap the caller's bookkeeping); frames are
written in submit order and a frame is written only once its future is done. A writer never reopens
an old segment: each process appends to a fresh one, so a torn tail left by a crash stays where it is
and is reported on every read.

A failed write or fsync fails the writer for good (`LogFailedError`, naming the I/O error): that
frame and every later one raise, nothing more is written, `close` seals nothing. A torn frame is
therefore always the last bytes of its segment, which recovery reads as a torn tail, so every frame
acknowledged before the failure comes back. Retrying is not safe: after a partial write the file
position is past bytes no index entry describes, and after a failed fsync the kernel may have dropped
the dirty pages, so a second fsync of the same file would succeed without them (fsyncgate). The run
stops; `--resume` appends to a fresh segment.

Reading verifies every frame: bytes past the last complete index entry are a torn tail (reported,
ignored); a frame whose crc32 does not match, or that does not parse, is corrupt (reported, skipped)
and the other frames and segments are still returned. A segment written under an older schema
that the caller still reads (`legacy_schemas`) yields its frames in that schema; upgrading them is
the caller's job.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from streamrl.buffer.types import RecoveryReport
from streamrl.core import iofaults
from streamrl.core.atomic import fsync_dir

logger = logging.getLogger(__name__)

_MAGIC = 0x53524C31  # "SRL1"
_ENTRY = struct.Struct("<IQQII")  # magic, offset, length, crc32(frame), num_rows
_ENTRY_SIZE = _ENTRY.size + 4  # + crc32(entry)
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class LogFailedError(OSError):
    """A write or fsync of a buffer log failed; the writer accepts no more writes (see the module docstring)."""


@dataclass(kw_only=True, slots=True)
class SegmentInfo:
    name: str
    num_frames: int = 0
    num_rows: int = 0
    num_bytes: int = 0
    sealed: bool = False


def segment_paths(directory: Path, prefix: str, suffix: str = "arrow") -> list[tuple[int, Path]]:
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d{{6}})\.{suffix}$")
    found = [(int(m.group(1)), p) for p in directory.glob(f"{prefix}-*.{suffix}") if (m := pattern.match(p.name))]
    return sorted(found)


def next_segment_index(directory: Path, prefix: str) -> int:
    """The number of this process's first segment: past every segment file *and* every index file,
    since an index can outlive its segment (a power loss that kept only the .idx entry, or a lost
    last segment) and a new segment must never collide with either."""
    numbers = [n for suffix in ("arrow", "idx") for n, _ in segment_paths(directory, prefix, suffix)]
    return max(numbers, default=0) + 1


class SegmentWriter:
    """Appends frames to `<prefix>-NNNNNN.arrow` segments, rolling after `segment_max_bytes`.

    Use either `write` (in the caller's thread) or `submit` (background thread) at a time; read
    `segments` and call `sync` / `close` only once every submitted future is done."""

    def __init__(
        self,
        directory: Path,
        *,
        prefix: str,
        schema: pa.Schema,
        segment_max_bytes: int,
        io: iofaults.PlainIO | None = None,
    ) -> None:
        self.directory = directory
        self._io = io or iofaults.active()
        self.prefix = prefix
        self.schema = schema
        self.segment_max_bytes = segment_max_bytes
        self._next_index = next_segment_index(directory, prefix)
        self.segments: list[SegmentInfo] = []
        self._data: int | None = None  # file descriptors of the open segment's .arrow and .idx
        self._idx: int | None = None
        self._offset = 0
        self._thread: ThreadPoolExecutor | None = None
        self.error: OSError | None = None  # the I/O error that failed this writer (then it writes nothing more)

    def _open_segment(self) -> None:
        name = f"{self.prefix}-{self._next_index:06d}"
        self._next_index += 1
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self._data = os.open(self.directory / f"{name}.arrow", flags, 0o666)  # closed in _seal
        self._idx = os.open(self.directory / f"{name}.idx", flags, 0o666)
        header = self.schema.serialize()
        self._write_all(self._data, header)
        self._offset = header.size
        self.segments.append(SegmentInfo(name=name, num_bytes=self._offset))
        fsync_dir(self.directory)

    def open(self) -> None:
        """Start a segment (file creation, directory fsync) and the writer thread now rather than at
        the first write."""
        thread = self._ensure_thread()
        if self._data is None:
            thread.submit(self._guarded, "opening a segment", self._open_segment).result()

    def write(self, batch: pa.RecordBatch) -> None:
        """Write one frame and flush it to the OS; LogFailedError if this or an earlier write failed."""
        self._guarded(f"writing a frame of {batch.num_rows} rows", self._write_frame, batch)

    def _guarded(self, what: str, fn, *args) -> None:
        """Run `fn(*args)` unless the writer failed before; an OSError fails it for good."""
        if self.error is not None:
            raise LogFailedError(self._failure_message("is failed")) from self.error
        try:
            fn(*args)
        except OSError as e:
            self.error = e
            raise LogFailedError(self._failure_message(f"failed {what}")) from e

    def _failure_message(self, how: str) -> str:
        where = self.segments[-1].name if self.segments else self.prefix
        return (
            f"buffer log {where} {how}: {self.error}. The log accepts no more writes: rows not flushed "
            "before this error are not acknowledged. Free the disk and restart the run with --resume "
            "(every acknowledged row is recovered)"
        )

    def _write_frame(self, batch: pa.RecordBatch) -> None:
        if self._data is None:
            self._open_segment()
        data, idx = self._open_files()
        frame = batch.serialize()
        crc = zlib.crc32(frame)
        self._write_all(data, frame)
        entry = _ENTRY.pack(_MAGIC, self._offset, frame.size, crc, batch.num_rows)
        self._write_all(idx, entry + struct.pack("<I", zlib.crc32(entry)))
        self._offset += frame.size
        info = self.segments[-1]
        info.num_frames += 1
        info.num_rows += batch.num_rows
        info.num_bytes = self._offset
        if self._offset >= self.segment_max_bytes:
            self._seal()

    def _open_files(self) -> tuple[int, int]:
        """The open segment's .arrow and .idx descriptors. Only a failed open leaves one of them
        unset, and a failed writer writes nothing more."""
        assert self._data is not None and self._idx is not None, "no open segment"
        return self._data, self._idx

    def _write_all(self, fd: int, data: bytes | pa.Buffer) -> None:
        view = memoryview(data)
        while len(view):
            view = view[self._io.write(fd, view, log=self.prefix) :]

    def submit(self, batch: pa.RecordBatch) -> Future[None]:
        """Queue one frame for the background writer thread; its future is done once `write` is."""
        return self._ensure_thread().submit(self.write, batch)

    def _ensure_thread(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"streamrl-log-{self.prefix}")
        return self._thread

    def sync(self) -> None:
        """fsync both files of the open segment; a failure fails the writer (never retried)."""
        self._guarded("to fsync", self._sync)

    def _sync(self) -> None:
        for fd in (self._data, self._idx):
            if fd is not None:
                self._io.fsync(fd, log=self.prefix)

    def _seal(self) -> None:
        data, idx = self._open_files()
        self._write_all(data, _EOS)
        self._sync()
        os.close(data)
        os.close(idx)
        self._data = self._idx = None
        self.segments[-1].sealed = True
        self.segments[-1].num_bytes += len(_EOS)

    def close(self) -> None:
        """Wait for submitted frames, stop the writer thread, seal the open segment (a failed writer
        only closes its files: a seal would write after the torn bytes)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._data is None:
            return
        if self.error is None:
            self._guarded("sealing a segment", self._seal)
            return
        for fd in (self._data, self._idx):
            if fd is not None:  # a failed segment open may have created only the .arrow file
                os.close(fd)
        self._data = self._idx = None


def read_segments(
    directory: Path,
    *,
    prefix: str,
    schema: pa.Schema,
    report: RecoveryReport,
    expected: dict[str, int] | None = None,
    legacy_schemas: tuple[pa.Schema, ...] = (),
) -> Iterator[tuple[str, pa.RecordBatch]]:
    """Yield (segment name, batch) for every verified frame of every segment, in write order.

    `expected` maps segment name -> frame count from the manifest; missing or short segments are
    reported. Problems go to `report` and to this module's logger; they never stop the read."""
    paths = segment_paths(directory, prefix)
    present = {p.stem for _, p in paths}
    for name in sorted(set(expected or {}) - present):
        _problem(report.missing, f"segment {name}.arrow listed in the manifest is missing; its rows are lost")
    for _, path in paths:
        report.num_segments += 1
        num_frames = 0
        for batch in _read_segment(path, schema, report, legacy_schemas):
            num_frames += 1
            yield path.stem, batch
        want = (expected or {}).get(path.stem)
        if want is not None and num_frames < want:
            _problem(report.missing, f"segment {path.name}: manifest lists {want} frames, {num_frames} recovered")


def _read_segment(
    path: Path, schema: pa.Schema, report: RecoveryReport, legacy_schemas: tuple[pa.Schema, ...] = ()
) -> Iterator[pa.RecordBatch]:
    idx_path = path.with_suffix(".idx")
    entries = idx_path.read_bytes() if idx_path.exists() else b""
    size = path.stat().st_size
    with open(path, "rb") as f:
        try:
            file_schema = pa.ipc.open_stream(f).schema
        except (pa.ArrowInvalid, OSError) as e:  # cut short: a crash while the segment was created
            _problem(report.torn_tails, f"segment {path.name}: unreadable schema header ({e}); segment skipped")
            return
        except pa.ArrowException as e:  # whole but damaged (a bit flip): any other Arrow error
            _problem(
                report.corrupt, f"segment {path.name}: corrupt schema header ({type(e).__name__}: {e}); segment skipped"
            )
            return
        known = [s for s in (schema, *legacy_schemas) if file_schema.equals(s)]
        if not known:
            _problem(report.corrupt, f"segment {path.name}: schema differs from this build's; segment skipped")
            return
        schema = known[0]
        end = 0
        for i in range(len(entries) // _ENTRY_SIZE):
            raw = entries[i * _ENTRY_SIZE : (i + 1) * _ENTRY_SIZE]
            magic, offset, length, crc, num_rows = _ENTRY.unpack_from(raw)
            (entry_crc,) = struct.unpack_from("<I", raw, _ENTRY.size)
            where = f"segment {path.name} frame {i} (offset {offset}, {num_rows} rows)"
            if magic != _MAGIC or entry_crc != zlib.crc32(raw[: _ENTRY.size]):
                _problem(report.corrupt, f"segment {path.name}: index entry {i} is corrupt; rest of segment skipped")
                return
            if offset + length > size:
                _problem(report.torn_tails, f"{where}: indexed but only {size - offset} of {length} bytes on disk")
                return
            f.seek(offset)
            frame = f.read(length)
            end = offset + length
            if zlib.crc32(frame) != crc:
                _problem(
                    report.corrupt,
                    f"{where}: checksum mismatch (stored {crc:#010x}, computed {zlib.crc32(frame):#010x}); "
                    "frame skipped",
                )
                continue
            try:
                batch = pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(frame)), schema)
            except (pa.ArrowException, OSError) as e:
                _problem(report.corrupt, f"{where}: checksum ok but frame does not parse ({e}); frame skipped")
                continue
            report.num_frames += 1
            yield batch
        if len(entries) % _ENTRY_SIZE:
            _problem(
                report.torn_tails,
                f"segment {path.name}: torn index entry after frame {len(entries) // _ENTRY_SIZE - 1}",
            )
        tail = size - max(end, _header_size(schema))
        if tail > 0 and not _is_eos_tail(f, end, size):
            _problem(
                report.torn_tails,
                f"segment {path.name}: torn tail of {tail} bytes after the last complete frame ignored",
            )


def _header_size(schema: pa.Schema) -> int:
    return schema.serialize().size


def _is_eos_tail(f, end: int, size: int) -> bool:
    if size - end != len(_EOS):
        return False
    f.seek(end)
    return f.read(len(_EOS)) == _EOS


def _problem(sink: list[str], message: str) -> None:
    logger.warning("buffer log: %s", message)
    sink.append(message)
