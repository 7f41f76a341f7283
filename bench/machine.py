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
