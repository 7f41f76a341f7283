"""One memory and process budget per sandbox, for all its processes together: a cgroup v2 per run.

Resource limits (`RLIMIT_AS`, `RLIMIT_NPROC`) are per process: a program that forks 31 children,
each under the address-space limit, holds 32 times the memory a sandbox was given. Where this
process may write a cgroup v2 hierarchy at /sys/fs/cgroup with the memory and pids controllers,
each run gets a child cgroup of `/sys/fs/cgroup/streamrl-sandboxes` whose `memory.max` (no swap) and
`pids.max` bound the whole sandbox; the first stage joins it before anything forks, and
`memory.oom.group` makes the kernel's OOM killer end the whole sandbox when it goes over. Elsewhere
(cgroup v1, no write access, a container whose cgroup root holds processes) the sandbox falls back
to the per-process limits, which stay on in both cases (they give a program a MemoryError for one
huge allocation, where the cgroup would kill it).

A cgroup is named `<owner>-<n>`, `owner` being the worker process's `pid-starttime`, so the sweep
(`reaper.py`) can remove those of a worker that died.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
BASE_NAME = "streamrl-sandboxes"
_CONTROLLERS = ("memory", "pids")


class CgroupBudget:
    """The cgroup v2 parent of the sandboxes' cgroups; `open` says why there is none."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._counter = itertools.count()

    @classmethod
    def open(cls, fs: Path = CGROUP_FS) -> tuple[CgroupBudget | None, str]:
        """The budget, or None and why cgroups cannot be used here."""
        controllers = fs / "cgroup.controllers"
        if not controllers.exists():
            return None, f"{fs} is not a cgroup v2 hierarchy"
        missing = set(_CONTROLLERS) - set(controllers.read_text().split())
        if missing:
            return None, f"the cgroup v2 hierarchy at {fs} lacks the {sorted(missing)} controller(s)"
        base = fs / BASE_NAME
        try:
            _enable_controllers(fs)
            base.mkdir(exist_ok=True)
            _enable_controllers(base)
        except OSError as exc:  # read-only, not ours, or EBUSY: a cgroup with processes cannot delegate
            return None, f"cannot set up {base}: {exc}"
        return cls(base), "ok"

    def create(self, owner: str, *, memory_mb: int, processes: int) -> Path:
        """A fresh cgroup for one run, its budget written; OSError if the kernel refuses."""
        path = self.base / f"{owner}-{next(self._counter)}"
        path.mkdir()
        try:
            _write(path / "memory.max", str(memory_mb << 20))
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0")
            _write(path / "memory.oom.group", "1")
            _write(path / "pids.max", str(processes))
        except OSError:
            remove(path)
            raise
        return path


def oom_killed(path: Path) -> bool:
    """Whether the kernel killed a process of the cgroup for going over its memory budget."""
    try:
        events = dict(line.split() for line in (path / "memory.events").read_text().splitlines())
    except (OSError, ValueError):
        return False
    return int(events.get("oom_kill", "0")) > 0 or int(events.get("oom_group_kill", "0")) > 0


def remove(path: Path, *, wait_s: float = 2.0) -> bool:
    """Kill whatever is left in the cgroup and remove it; False if it is still busy after `wait_s`."""
    kill = path / "cgroup.kill"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if kill.exists():
                _write(kill, "1")
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY: processes are still exiting
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def _enable_controllers(path: Path) -> None:
    control = path / "cgroup.subtree_control"
    enabled = set(control.read_text().split())
    wanted = [c for c in _CONTROLLERS if c not in enabled]
    if wanted:
        _write(control, " ".join(f"+{c}" for c in wanted))


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
