"""Write-then-rename, the one way streamrl replaces a file or a folder that a crash must never leave
half-written (driver state, run info, buffer manifest, checkpoints, SFT and model caches, weight-sync
versions): readers see the old content or the new, never a mix.

Renames survive a killed process as they are; `sync=True` also fsyncs the data and the parent folder,
for content that must survive a lost machine (driver state, run files, checkpoints, the buffer's
manifest on a durable flush): without it a lost machine may keep the rename but not the bytes.
A folder written with `atomic_dir(..., sync=True)` is *sealed*: every file is fsynced, then a
manifest of its files and sizes (`SEAL`) is written last and fsynced, then the folders. A sealed
folder is complete iff `unsealed_reason` finds the manifest and every file it lists at its size.
`build_once` is the cached-folder variant (model and SFT caches): built once under a file lock.

Writes and fsyncs go through `core.iofaults` (plain `os` calls unless a fault plan is armed):
`atomic_write` as the target `run/<file name>`, a sealed folder's files as `<log>/<path inside it>`
(`ckpt/optimizer.pt`, `ckpt/SEALED.json`: `atomic_dir(log=...)`), files a `write` callback opens with
`open_for_write`. When a write, an fsync or the rename fails (ENOSPC, EIO, a short write whose retry
failed, a failing fsync: real or injected), the failure is never retried or hidden: it raises
`WriteFailedError` (an `OSError` with the errno) naming the file, and
- `atomic_write` leaves the previous file intact (its temporary file is removed: nothing renamed);
- `atomic_dir` renames nothing into place and removes the partial folder, so a failed sealed folder
  has no seal anywhere; a previous folder of that name stays whole.
The one failure after the rename is the parent folder's fsync: the new content is then in place and
whole (a reader sees it), only its survival of a lost machine is unknown; it raises all the same.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from streamrl.core import iofaults


class WriteFailedError(OSError):
    """A write, fsync or rename of an atomic file or folder failed (module doc). `errno` is the
    cause's; the message names the file, the errno and what was kept."""


def _failed(cause: OSError, path: Path, what: str, kept: str) -> WriteFailedError:
    code = cause.errno or errno.EIO
    name = errno.errorcode.get(code, str(code))
    reason = cause.strerror or str(cause)
    return WriteFailedError(code, f"{name} {what} {path}: {reason}; {kept}")


class PlannedFile:
    """A new file (created or truncated) written and fsynced through the active I/O plan
    (`core.iofaults`) as the target `log`: short writes are finished, failures raised. Works as
    a binary file object for writers that take one (`torch.save`).

    A writer that catches the OSError of a `write` and raises its own error (torch turns it into a
    RuntimeError) does not hide it: leaving the `with` block re-raises the OSError itself."""

    def __init__(self, path: str | Path, *, log: str, io: iofaults.PlainIO | None = None) -> None:
        self.path, self.log = Path(path), log
        self._io = io or iofaults.active()
        self.error: OSError | None = None
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def _open_fd(self) -> int:
        assert self._fd is not None, f"{self.path} is closed"
        return self._fd

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            return iofaults.write_all(self._io, self._open_fd(), data, log=self.log)
        except OSError as e:
            raise self._fail(e) from e

    def flush(self) -> None:
        """Nothing is buffered: every `write` reached the kernel."""

    def fsync(self) -> None:
        try:
            self._io.fsync(self._open_fd(), log=self.log)
        except OSError as e:
            raise self._fail(e) from e

    def _fail(self, cause: OSError) -> OSError:
        """`cause`, with this file's path (an injected or kernel error names no file)."""
        self.error = OSError(cause.errno, cause.strerror or str(cause), str(self.path))
        return self.error

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> PlannedFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
        if exc is not None and self.error is not None and exc is not self.error:
            raise self.error  # the writer wrapped our OSError (its own error is the context): the errno matters


def open_for_write(path: str | Path, *, log: str) -> PlannedFile:
    """`path` opened for writing through the I/O plan as target `log` (`PlannedFile`)."""
    return PlannedFile(path, log=log)


def write_file(path: str | Path, data: str | bytes, *, log: str, sync: bool = False) -> Path:
    """Write `data` (text is UTF-8) to the new file `path` through the I/O plan as target `log`."""
    with PlannedFile(path, log=log) as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if sync:
            f.fsync()
    return Path(path)


def atomic_write(path: str | Path, data: str | bytes, *, sync: bool = False, log: str | None = None) -> Path:
    """Replace the file `path` with `data` (text is UTF-8); writes and fsync go through the I/O plan as
    the target `log` (default `run/<file name>`). A failure raises `WriteFailedError` and leaves the
    previous file intact (module doc)."""
    path = Path(path)
    log = log or f"run/{path.name}"
    if not isinstance(data, str | bytes | bytearray | memoryview):
        raise TypeError(f"atomic_write takes str or bytes, not {type(data).__name__}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    io = iofaults.active()
    try:
        try:
            iofaults.write_all(io, fd, data.encode() if isinstance(data, str) else data, log=log)
            if sync:
                io.fsync(fd, log=log)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise _failed(e, path, "writing", f"the previous {path.name} is intact (nothing of this write was kept)") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync:
        try:
            fsync_dir(path.parent)
        except OSError as e:
            kept = "the new content is in place, its durability unknown"
            raise _failed(e, path, "syncing the folder of", kept) from e
    return path


def atomic_dir(final: str | Path, write: Callable[[Path], object], *, sync: bool = False, log: str = "sealed") -> Path:
    """Run `write(tmp)` into a fresh sibling folder, then swap it into `final` (an existing `final`
    is replaced whole: it is moved aside, the new one renamed in, the old one deleted). `sync=True`
    seals the folder (module doc) before the rename and fsyncs the parent after it, and makes any
    parent folder it creates durable too; the seal's fsyncs and its manifest go through the I/O plan
    as `<log>/<path inside the folder>`. An OSError (of `write`, the seal or the rename) raises
    `WriteFailedError` naming the file: nothing is renamed into place and the partial folder is removed."""
    final = Path(final).resolve()
    make_dirs(final.parent, sync=sync)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        if sync:
            seal_dir(tmp, log=log)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except WriteFailedError:
        raise
    except OSError as e:
        where = final
        if e.filename is not None and Path(e.filename).is_relative_to(tmp):
            where = final / Path(e.filename).relative_to(tmp)
        kept = f"nothing was renamed into place and the partial {final.name} was removed" + (
            ", so no seal of it is left" if sync else ""
        )
        raise _failed(e, where, "writing", kept) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if sync:
        try:
            fsync_dir(final.parent)
        except OSError as e:
            raise _failed(e, final, "syncing the folder of", "it is in place and sealed, its durability unknown") from e
    return final


def make_dirs(folder: str | Path, *, sync: bool = False) -> None:
    """`mkdir -p folder`; with `sync`, fsync the parent of every folder it creates: a new folder's
    entry lives in its parent, so without it a lost machine can drop the folder with all under it."""
    folder = Path(folder)
    created = []
    ancestor = folder
    while not ancestor.exists():
        created.append(ancestor)
        ancestor = ancestor.parent
    folder.mkdir(parents=True, exist_ok=True)
    if sync:
        for new in reversed(created):  # outermost first
            fsync_dir(new.parent)


def build_once(
    final: str | Path, build: Callable[[Path], object], *, rebuild: bool = False, marker: str = "config.json"
) -> Path:
    """The cached folder `final`, built by `build(tmp)` (`atomic_dir`) when it lacks `marker` (or
    always, with `rebuild`). Builders of one folder take turns on a file lock beside it, and a waiter
    finding it built when its turn comes uses it: concurrent runs sharing a cache build it once, and
    none swaps a folder away under another that is already reading it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if not rebuild and (final / marker).exists():
        return final
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not rebuild and (final / marker).exists():
            return final
        return atomic_dir(final, build)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` survive a lost machine."""
    _fsync(path)


SEAL = "SEALED.json"  # {relative path: size in bytes} of every other file of a sealed folder


def seal_dir(folder: Path, *, log: str = "sealed") -> None:
    """fsync every file under `folder`, write the `SEAL` manifest last (fsynced), then fsync every
    folder bottom-up: once this returns, a lost machine keeps all of it or the seal is missing.
    The files' fsyncs and the seal go through the I/O plan as `<log>/<path inside the folder>`; an
    OSError carries the failing file's path (`filename`)."""
    folder = Path(folder)
    io = iofaults.active()
    sizes: dict[str, int] = {}
    folders = [folder]
    for path in sorted(folder.rglob("*")):
        if path.is_dir():
            folders.append(path)
        elif path.name != SEAL:
            rel = str(path.relative_to(folder))
            _fsync(path, io=io, log=f"{log}/{rel}")
            sizes[rel] = path.stat().st_size
    write_file(folder / SEAL, json.dumps(sizes, indent=1), log=f"{log}/{SEAL}", sync=True)
    for path in reversed(folders):  # children before parents
        fsync_dir(path)


def unsealed_reason(folder: Path) -> str | None:
    """None when `folder` is sealed and whole; else why not (no seal, a file missing or truncated)."""
    folder = Path(folder)
    try:
        sizes = json.loads((folder / SEAL).read_text())
    except FileNotFoundError:
        return f"{folder} has no {SEAL} (never sealed, or torn)"
    except ValueError:
        return f"{folder}/{SEAL} is not valid JSON (torn)"
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, the seal says {size}"
    return None


def _fsync(path: Path, *, io: iofaults.PlainIO = iofaults.PLAIN_IO, log: str = "") -> None:
    """fsync a file's data, or a folder's entries (both opened read-only); an OSError names `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        io.fsync(fd, log=log)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    finally:
        os.close(fd)
