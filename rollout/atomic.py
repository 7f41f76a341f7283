"""Write-then-rename, the one way streamrl replaces a file or a folder that a crash must never leave
half-written (driver state, run info, buffer manifest, checkpoints, SFT and model caches, weight-sync
versions): readers see the old content or the new, never a mix.

Renames survive a killed process as they are; `sync=True` also fsyncs the data and the parent folder,
for content that must survive a lost machine (the buffer's manifest on a durable flush).
`build_once` is the cached-folder variant (model and SFT caches): built once under a file lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, data: str | bytes, *, sync: bool = False) -> Path:
    """Replace the file `path` with `data` (text is UTF-8)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync:
        fsync_dir(path.parent)
    return path


def atomic_dir(final: str | Path, write: Callable[[Path], object]) -> Path:
    """Run `write(tmp)` into a fresh sibling folder, then swap it into `final` (an existing `final`
    is replaced whole: it is moved aside, the new one renamed in, the old one deleted)."""
    final = Path(final).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_once(final: str | Path, build: Callable[[Path], object], *, rebuild: bool = False,
               marker: str = "config.json") -> Path:
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
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
