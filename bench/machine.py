"""The machine a benchmark ran on, for the `machine` field of every bench/results JSON."""

from __future__ import annotations

import os
import platform
from typing import Any


def machine(**extra: Any) -> dict[str, Any]:
    """Platform, CPU model (from /proc/cpuinfo where there is one), core count and Python version,
    plus `extra` (library versions and the like)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        **extra,
    }


PRESSURE = "/proc/pressure/cpu"  # Linux pressure stall information: the share of time tasks waited for a core


def cpu_pressure(path: str = PRESSURE) -> float | None:
    """The share of the last 10 s some runnable task waited for a core (0-1), None without PSI."""
    try:
        with open(path) as f:
            first = f.readline().split()  # "some avg10=67.70 avg60=45.55 avg300=31.29 total=..."
        return float(dict(field.split("=") for field in first[1:])["avg10"]) / 100
    except (OSError, KeyError, ValueError):
        return None


def settle(quiet: float = 0.10, timeout_s: float = 60.0, poll_s: float = 2.0, path: str = PRESSURE) -> float:
    """Wait until the cores are quiet (CPU pressure at most `quiet`: what a finished run left behind,
    its engines and Ray workers on their way out, has ended) or `timeout_s` has passed; without PSI,
    wait `poll_s * 5`. Returns the seconds waited."""
    import time

    t0 = time.monotonic()
    while True:
        pressure = cpu_pressure(path)
        if pressure is None:
            time.sleep(poll_s * 5)
            return time.monotonic() - t0
        if pressure <= quiet or time.monotonic() - t0 >= timeout_s:
            return time.monotonic() - t0
        time.sleep(poll_s)


def speed_probe(size: int = 512, calls: int = 200, blocks: int = 5) -> float:
    """Milliseconds per `size`-cubed float32 matrix product on all cores, the median of `blocks`
    timed blocks of `calls` products (about a second): how fast this machine computes right now. On
    a shared machine other users change it through a day; a benchmark records it beside its runs
    (after `settle`, else it times its own runs' leftovers) to tell a slower machine from a slower
    program."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
        for _ in range(calls // 10):  # warm-up: allocation, thread pool
            a @ b
        times = []
        for _ in range(blocks):
            t0 = time.perf_counter()
            for _ in range(calls):
                a @ b
            times.append((time.perf_counter() - t0) * 1000 / calls)
        return float(sorted(times)[blocks // 2])
    finally:
        torch.set_num_threads(threads)
