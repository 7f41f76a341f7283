"""Pinning a process's threads to CPU cores, and reading back where they may run (Linux).

A part placed on its own cores (`streaming.placement`) calls `pin_process` once, early in its own
process: every thread that exists is pinned (Ray's and gRPC's included, so nothing of the part
drifts onto another part's cores) and threads started later inherit the mask from the thread that
starts them. `thread_affinities` reads the masks from /proc, the way a test or an operator checks
that two parts never overlap.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def parse_cpu_list(text: str) -> set[int]:
    """'0-2,5' (the kernel's list format, as in Cpus_allowed_list) → {0, 1, 2, 5}."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def pin_process(cores: Iterable[int]) -> set[int]:
    """Pin every thread of this process to `cores`; returns the mask. OSError (EINVAL) names the
    cores when none of them exist or are allowed here. The caller sizes its thread pools to the mask
    (`streaming.placement.pin_part` does torch's)."""
    mask = set(cores)
    if not mask:
        raise ValueError("pin_process needs at least one core")
    try:
        os.sched_setaffinity(0, mask)  # the calling thread first: threads it starts inherit the mask
    except OSError as exc:
        raise OSError(exc.errno, f"cannot pin to cores {sorted(mask)}: {exc.strerror}") from exc
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
            continue
    os.environ["OMP_NUM_THREADS"] = str(len(mask))  # for anything that reads it later (OpenMP, vLLM)
    return mask


def thread_affinities(pid: int) -> dict[int, set[int]]:
    """{thread id: cores it may run on} for every live thread of process `pid`, from /proc."""
    result: dict[int, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                result[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
    return result
