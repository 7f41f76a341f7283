"""Sandboxes never outlive their worker: a record of each running sandbox, and the sweep.

The first line of defence is in the sandbox's own chain (`stages.py`): every stage asks the
kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), so a worker killed outright takes its
sandboxes with it. This module is the second: while a sandbox runs, a file
`<registry>/<owner>/<pgid>-<starttime>` names its process group, `owner` being the worker's
`<pid>-<starttime>` (a pid alone may be reused). `sweep` kills the sandboxes, and removes the
cgroups, of every owner that is no longer alive (a worker starting up calls it); `kill_owned` kills
the running sandboxes of one `Sandbox` (the worker's shutdown).

A record is an order to kill, so only this user's records are obeyed. The registry is a directory of
this user's that no one else may write (`default_registry`: `<tmp>/streamrl-sandboxes-<uid>`, mode
0700, checked after it is made, never followed through a symlink); owner folders and records must be
plain entries of this user's. A process group is killed only when its leader is the very process
recorded (same pid and start time), runs as this user, leads its own group and started after its
owner: the leader is the sandbox's first stage, which lives as long as the sandbox (it waits for it or
becomes it by exec).
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from streamrl.tools.sandbox import cgroup as sandbox_cgroup

logger = logging.getLogger(__name__)


class UnsafeRegistry(ValueError):
    """A registry directory someone else could write records into: its records are not obeyed."""


def process_key(pid: int) -> str | None:
    """`<pid>-<starttime>` of a live process (None if it is gone): unique across pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has already exited
        return None
    return f"{pid}-{fields[19]}"  # field 22 of stat: start time in clock ticks since boot


class SandboxRegistry:
    """The records of the sandboxes one `Sandbox` of this process runs (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = private_dir(root)
        owner = process_key(os.getpid())
        assert owner is not None, "this process is alive"
        self.owner = owner
        self.dir = root / owner
        self._live: set[Path] = set()

    def add(self, pgid: int) -> Path | None:
        """Record a sandbox whose first stage (its process group's leader) is `pgid`."""
        key = process_key(pgid)
        if key is None:  # already gone
            return None
        self.dir.mkdir(exist_ok=True, mode=0o700)
        path = self.dir / key
        path.touch()
        self._live.add(path)
        return path

    def discard(self, record: Path | None) -> None:
        if record is not None:
            self._live.discard(record)
            record.unlink(missing_ok=True)

    def kill_owned(self) -> int:
        """Kill the sandboxes recorded here that still run; the number killed."""
        records, self._live = self._live, set()
        return _kill(records, self.owner)


def registry_root(registry_dir: str | None) -> Path:
    """Where a `Sandbox` keeps its records: `registry_dir` (its records are not obeyed, UnsafeRegistry,
    when others may write it), else `default_registry`, or, when someone else has taken that one, a
    fresh private directory (the records of workers that died are then not swept)."""
    if registry_dir is not None:
        return private_dir(Path(registry_dir))
    try:
        return default_registry()
    except UnsafeRegistry as exc:
        logger.warning("%s: not used; the sandboxes of workers that died are not swept", exc)
        return Path(tempfile.mkdtemp(prefix="streamrl-sandboxes-"))


def default_registry() -> Path:
    """`<tmp>/streamrl-sandboxes-<uid>`, made private to this user; UnsafeRegistry when a directory of
    that name is there already and someone else could write it."""
    return private_dir(Path(tempfile.gettempdir()) / f"streamrl-sandboxes-{os.geteuid()}")


def private_dir(path: Path) -> Path:
    """`path`, a directory made (mode 0700) if missing, and checked: not a symlink, owned by this
    user, open to no one else. UnsafeRegistry otherwise."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeRegistry(f"sandbox registry {path} is not a directory (a symlink or a file)")
    if info.st_uid != os.geteuid():
        raise UnsafeRegistry(f"sandbox registry {path} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & 0o077:
        raise UnsafeRegistry(f"sandbox registry {path} is open to other users (mode {stat.S_IMODE(info.st_mode):o})")
    return path


def sweep(root: Path, cgroups: sandbox_cgroup.CgroupBudget | None = None) -> int:
    """Kill the sandboxes and remove the cgroups of owners no longer alive; the number killed. A
    registry someone else could write is not read (a warning says so)."""
    killed = 0
    try:
        owners = [o for o in private_dir(root).iterdir() if _ours(o, stat.S_ISDIR)] if root.exists() else []
    except UnsafeRegistry as exc:
        logger.warning("%s: its records are ignored", exc)
        owners = []
    for owner in owners:
        if not _alive(owner.name):
            killed += _kill_recorded(owner)
    if cgroups is not None:
        for path in cgroups.base.iterdir():
            owner = path.name.rsplit("-", 1)[0]
            if path.is_dir() and not _alive(owner):
                sandbox_cgroup.remove(path, wait_s=0.5)
    if killed:
        logger.warning("killed %d sandbox(es) left behind by workers that died", killed)
    return killed


def _alive(key: str) -> bool:
    pid, _, _ = key.partition("-")
    return pid.isdigit() and process_key(int(pid)) == key


def _ours(path: Path, is_kind: Callable[[int], bool]) -> bool:
    """Whether `path` is of that kind (`stat.S_ISDIR`, `stat.S_ISREG`: a symlink is neither) and this user's."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return is_kind(info.st_mode) and info.st_uid == os.geteuid()


def _kill_recorded(owner_dir: Path) -> int:
    killed = _kill([r for r in owner_dir.glob("*-*") if _ours(r, stat.S_ISREG)], owner_dir.name)
    try:
        owner_dir.rmdir()
    except OSError:  # not empty (a sandbox started meanwhile) or already gone
        pass
    return killed


def _kill(records: Iterable[Path], owner: str) -> int:
    killed = 0
    for record in list(records):
        if _started_by(record.name, owner):
            try:
                os.killpg(int(record.name.partition("-")[0]), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        record.unlink(missing_ok=True)
    return killed


def _started_by(key: str, owner: str) -> bool:
    """Whether the process `key` (`<pid>-<starttime>`) is alive as recorded, runs as this user (its
    real uid: a setuid bwrap keeps it), leads its own process group and started no earlier than
    `owner` (a worker's key), as a sandbox it ran."""
    if not _alive(key):
        return False
    pid, started = (int(part) for part in key.split("-", 1))
    owner_started = owner.partition("-")[2]
    if not owner_started.isdigit() or started < int(owner_started):
        return False
    try:
        if os.getpgid(pid) != pid:
            return False
        uids = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return False
    return int(uids.split()[1]) == os.getuid()
