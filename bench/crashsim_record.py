"""Record the file-system operations a workload hands to the OS, for crash-state exploration (`bench.crashsim`).

ALICE and CrashMonkey record a workload's system calls and then build every state a power loss could
leave. This is the recording half, in-process: while a `Recorder` is active it wraps the `os` calls
(`open`, `write`, `ftruncate`, `fsync`, `replace`/`rename`, `unlink`, `mkdir`, `rmdir`, `close`) and
`io.open`/`builtins.open` (so `Path.write_text`, `os.fdopen`, `json.dump` into a file object all
count): a file object opened for writing gets a `FileIO` whose `write`/`truncate` record exactly the
bytes each system call receives, below Python's buffering. Only paths under `root` are recorded;
`dir_fd`-relative calls (`shutil.rmtree`) are resolved through `/proc/self/fd`. Calls are serialized
under one lock, so the trace's order is the order the OS saw them, background writer threads included.

Files and folders are named by a model inode (`Op.ino`), so writes through an open descriptor follow
its file across renames. `mark(name, value)` notes that the workload acknowledged something (a row
is durable, a state was saved) after the operations recorded so far.
"""

from __future__ import annotations

import builtins
import io
import os
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class OpKind(StrEnum):
    CREATE = "create"  # a new file at `path` (inode `ino`)
    MKDIR = "mkdir"  # a new folder at `path` (inode `ino`)
    WRITE = "write"  # `data` at `offset` of inode `ino`
    TRUNCATE = "truncate"  # inode `ino` to `size` bytes
    FSYNC = "fsync"  # inode `ino`: a file's data, or a folder's entries
    RENAME = "rename"  # `path` -> `dest` (replacing `dest`)
    UNLINK = "unlink"  # the entry `path` (a file or an empty folder)


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    kind: OpKind
    ino: int = -1
    path: str = ""  # relative to the recorder's root, "/"-separated
    dest: str = ""
    offset: int = 0
    size: int = 0
    data: bytes = b""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mark:
    at: int  # number of operations recorded before the workload acknowledged this
    name: str
    value: Any


@dataclass(kw_only=True, slots=True)
class Trace:
    """What a workload did: the tree under root before it (`initial`: path -> (inode, bytes or None
    for a folder); all of it durable), its operations and its acknowledgements."""

    root_ino: int
    initial: dict[str, tuple[int, bytes | None]]
    ops: list[Op] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)


_active: Recorder | None = None
_REAL = {
    name: getattr(os, name)
    for name in (
        "open",
        "close",
        "write",
        "ftruncate",
        "fsync",
        "fdatasync",
        "replace",
        "rename",
        "unlink",
        "remove",
        "mkdir",
        "rmdir",
    )
}
_REAL_OPEN = io.open


class Recorder:
    """`with Recorder(root) as rec: workload(); rec.trace` (one active recorder per process)."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self._lock = threading.RLock()
        self._next_ino = 1
        self._inos: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> model inode
        self._fds: dict[int, int] = {}  # open descriptor -> model inode
        root_ino = self._inode(os.stat(self.root))
        self.trace = Trace(root_ino=root_ino, initial=self._snapshot())

    def _snapshot(self) -> dict[str, tuple[int, bytes | None]]:
        initial: dict[str, tuple[int, bytes | None]] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                ino = self._inode(os.stat(full))
                initial[self.rel(full)] = (ino, None if name in dirnames else Path(full).read_bytes())
        return initial

    def _inode(self, st: os.stat_result, *, new: bool = False) -> int:
        key = (st.st_dev, st.st_ino)
        if new or key not in self._inos:  # the OS reuses numbers of deleted inodes
            self._inos[key] = self._next_ino
            self._next_ino += 1
        return self._inos[key]

    def rel(self, path: Any, dir_fd: int | None = None) -> str | None:
        """`path` relative to root ("" for root itself), or None outside it."""
        path = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        path = os.path.abspath(path)
        parent, name = os.path.split(path)
        path = os.path.join(os.path.realpath(parent), name) if name else os.path.realpath(path)
        if path == self.root:
            return ""
        return path[len(self.root) + 1 :] if path.startswith(self.root + os.sep) else None

    def mark(self, name: str, value: Any = None) -> None:
        with self._lock:
            self.trace.marks.append(Mark(at=len(self.trace.ops), name=name, value=value))

    def _add(self, op: Op) -> None:
        self.trace.ops.append(op)

    def __enter__(self) -> Recorder:
        global _active
        assert _active is None, "one recorder at a time"
        _active = self
        for name, fn in _WRAPPERS.items():
            setattr(os, name, fn)
        io.open = builtins.open = _open
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        for name, fn in _REAL.items():
            setattr(os, name, fn)
        io.open = builtins.open = _REAL_OPEN
        _active = None

    # ---------------------------------------------------------------- the recorded calls
    def opened(self, fd: int, rel: str | None, *, created: bool, truncated: bool) -> None:
        if rel is None:
            self._fds.pop(fd, None)
            return
        ino = self._inode(os.fstat(fd), new=created)
        self._fds[fd] = ino
        if created:
            self._add(Op(kind=OpKind.CREATE, ino=ino, path=rel))
        elif truncated:
            self._add(Op(kind=OpKind.TRUNCATE, ino=ino, size=0))

    def wrote(self, fd: int, data: Any, n: int) -> None:
        if fd in self._fds and n:
            end = os.lseek(fd, 0, os.SEEK_CUR)  # after the write, also under O_APPEND
            self._add(Op(kind=OpKind.WRITE, ino=self._fds[fd], offset=end - n, data=bytes(memoryview(data)[:n])))

    def truncated(self, fd: int, size: int) -> None:
        if fd in self._fds:
            self._add(Op(kind=OpKind.TRUNCATE, ino=self._fds[fd], size=size))


def _creates(path: Any, flags: int, dir_fd: int | None) -> bool:
    return bool(flags & os.O_CREAT) and not os.path.lexists(
        path if dir_fd is None else f"/proc/self/fd/{dir_fd}/{os.fsdecode(path)}"
    )


def _w_open(path, flags, mode=0o777, *, dir_fd=None):
    rec = _active
    with rec._lock:
        rel = rec.rel(path, dir_fd)
        created = rel is not None and _creates(path, flags, dir_fd)
        fd = _REAL["open"](path, flags, mode, dir_fd=dir_fd)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        rec.opened(fd, rel, created=created, truncated=bool(flags & os.O_TRUNC) and writable)
        return fd


def _w_close(fd):
    with _active._lock:
        _active._fds.pop(fd, None)
        return _REAL["close"](fd)


def _w_write(fd, data):
    with _active._lock:
        n = _REAL["write"](fd, data)
        _active.wrote(fd, data, n)
        return n


def _w_ftruncate(fd, size):
    with _active._lock:
        _REAL["ftruncate"](fd, size)
        _active.truncated(fd, size)


def _fsync_as(name: str):
    def fsync(fd):
        rec = _active
        with rec._lock:
            fd = fd if isinstance(fd, int) else fd.fileno()
            _REAL[name](fd)
            if fd in rec._fds:
                rec._add(Op(kind=OpKind.FSYNC, ino=rec._fds[fd]))

    return fsync


def _rename_as(name: str):
    def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        rec = _active
        with rec._lock:
            a, b = rec.rel(src, src_dir_fd), rec.rel(dst, dst_dir_fd)
            _REAL[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            assert (a is None) == (b is None), f"rename across the recorded root: {src} -> {dst}"
            if a is not None:
                rec._add(Op(kind=OpKind.RENAME, path=a, dest=b))

    return rename


def _unlink_as(name: str):
    def unlink(path, *, dir_fd=None):
        rec = _active
        with rec._lock:
            rel = rec.rel(path, dir_fd)
            _REAL[name](path, dir_fd=dir_fd)
            if rel is not None:
                rec._add(Op(kind=OpKind.UNLINK, path=rel))

    return unlink


def _w_mkdir(path, mode=0o777, *, dir_fd=None):
    rec = _active
    with rec._lock:
        rel = rec.rel(path, dir_fd)
        _REAL["mkdir"](path, mode, dir_fd=dir_fd)
        if rel is not None:
            full = path if dir_fd is None else f"/proc/self/fd/{dir_fd}/{os.fsdecode(path)}"
            rec._add(Op(kind=OpKind.MKDIR, ino=rec._inode(os.stat(full), new=True), path=rel))


_WRAPPERS = {
    "open": _w_open,
    "close": _w_close,
    "write": _w_write,
    "ftruncate": _w_ftruncate,
    "fsync": _fsync_as("fsync"),
    "fdatasync": _fsync_as("fdatasync"),
    "replace": _rename_as("replace"),
    "rename": _rename_as("rename"),
    "unlink": _unlink_as("unlink"),
    "remove": _unlink_as("remove"),
    "mkdir": _w_mkdir,
    "rmdir": _unlink_as("rmdir"),
}


class _RecordingFileIO(io.FileIO):
    """A `FileIO` whose writes and truncations (one system call each) go into the trace while a
    recorder is active (a file object may outlive it)."""

    def write(self, b) -> int | None:
        rec = _active
        if rec is None:
            return super().write(b)
        with rec._lock:
            n = super().write(b)
            if n:
                rec.wrote(self.fileno(), b, n)
            return n

    def truncate(self, size: int | None = None) -> int:
        rec = _active
        if rec is None:
            return super().truncate(size)
        with rec._lock:
            size = super().truncate(size)
            rec.truncated(self.fileno(), size)
            return size

    def close(self) -> None:
        rec = _active
        if rec is not None and not self.closed:
            with rec._lock:
                rec._fds.pop(self.fileno(), None)
        super().close()


def _open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True, opener=None):
    """`io.open` for a file under the root opened for writing: the same layers over a recording FileIO."""
    rec = _active
    writing = any(c in mode for c in "wax+")
    rel = None if isinstance(file, int) else rec.rel(file)
    if not writing or (rel is None and not isinstance(file, int)):
        f = _REAL_OPEN(file, mode, buffering, encoding, errors, newline, closefd, opener)
        if not isinstance(file, int):
            rec._fds.pop(f.fileno(), None)
        return f
    with rec._lock:
        created = rel is not None and not os.path.lexists(file) and "r" not in mode
        raw = _RecordingFileIO(file, mode.replace("b", "").replace("t", ""), closefd, opener=opener)
        if rel is not None:
            rec.opened(raw.fileno(), rel, created=created, truncated="w" in mode)
    binary = "b" in mode
    if buffering == 0:
        if not binary:
            raise ValueError("can't have unbuffered text I/O")
        return raw
    size = io.DEFAULT_BUFFER_SIZE if buffering in (-1, 1) else buffering
    buffer = (io.BufferedRandom if "+" in mode else io.BufferedWriter)(raw, size)
    if binary:
        return buffer
    text = io.TextIOWrapper(buffer, encoding, errors, newline, line_buffering=buffering == 1)
    text.mode = mode
    return text
