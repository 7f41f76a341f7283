"""Sandboxes never outlive their worker: a record of each running sandbox, and the sweep.

The first line of defence is in the sandbox's own chain (`stages.py`): every stage asks the
kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), so a worker killed outright takes its
sandboxes with it. This module is the second: while a sandbox runs, a file
`<registry>/<owner>/<pgid>-<starttime>` names its process group, `owner` being the worker's
`<pid>-<starttime>` (a pid alone may be reused). `sweep` kills the sandboxes, and removes the
cgroups, of every owner that is no longer alive (a worker starting up calls it); `kill_owned` kills
the running sandboxes of one `Sandbox` (the worker's shutdown). A process group is only killed when
its leader is the very process recorded (same pid and start time): the leader is the sandbox's first
stage, which lives as long as the sandbox (it waits for it or becomes it by exec).
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from collections.abc import Iterable
from pathlib import Path

from streamrl.rollout.tools.sandbox import cgroup as sandbox_cgroup

logger = logging.getLogger(__name__)

DEFAULT_REGISTRY = Path(tempfile.gettempdir()) / "streamrl-sandboxes"


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

    def __init__(self, root: Path = DEFAULT_REGISTRY) -> None:
        self.root = root
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
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
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
        return _kill(records)


def sweep(root: Path = DEFAULT_REGISTRY, cgroups: sandbox_cgroup.CgroupBudget | None = None) -> int:
    """Kill the sandboxes and remove the cgroups of owners no longer alive; the number killed."""
    killed = 0
    if root.is_dir():
        for owner in root.iterdir():
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


def _kill_recorded(owner_dir: Path) -> int:
    killed = _kill(owner_dir.glob("*-*"))
    try:
        owner_dir.rmdir()
    except OSError:  # not empty (a sandbox started meanwhile) or already gone
        pass
    return killed


def _kill(records: Iterable[Path]) -> int:
    killed = 0
    for record in list(records):
        pgid = record.name.partition("-")[0]
        if pgid.isdigit() and _alive(record.name):
            try:
                os.killpg(int(pgid), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        record.unlink(missing_ok=True)
    return killed
