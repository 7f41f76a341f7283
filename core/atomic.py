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
"""

from __future__ import annotations

import fcntl
import json
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


def atomic_dir(final: str | Path, write: Callable[[Path], object], *, sync: bool = False) -> Path:
    """Run `write(tmp)` into a fresh sibling folder, then swap it into `final` (an existing `final`
    is replaced whole: it is moved aside, the new one renamed in, the old one deleted). `sync=True`
    seals the folder (module doc) before the rename and fsyncs the parent after it, and makes any
    parent folder it creates durable too."""
    final = Path(final).resolve()
    make_dirs(final.parent, sync=sync)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        if sync:
            seal_dir(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if sync:
        fsync_dir(final.parent)
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


def seal_dir(folder: Path) -> None:
    """fsync every file under `folder`, write the `SEAL` manifest last (fsynced), then fsync every
    folder bottom-up: once this returns, a lost machine keeps all of it or the seal is missing."""
    folder = Path(folder)
    sizes: dict[str, int] = {}
    folders = [folder]
    for path in sorted(folder.rglob("*")):
        if path.is_dir():
            folders.append(path)
        elif path.name != SEAL:
            _fsync(path)
            sizes[str(path.relative_to(folder))] = path.stat().st_size
    with open(folder / SEAL, "w") as f:
        json.dump(sizes, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
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


def _fsync(path: Path) -> None:
    """fsync a file's data, or a folder's entries (both opened read-only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
