"""`make bench`: run every benchmark, each in its own process, and print where the JSON went.

Each module writes bench/results/<name>.json with the command that produced it and the machine.
A failing benchmark is reported and the others still run; the exit code is non-zero if any failed.
"""

from __future__ import annotations

import subprocess
import sys
import time

BENCHMARKS = [
    "bench.buffer",
    "bench.learner",
    "bench.checkpoint_async",
    "bench.weight_sync",
    "bench.async_vs_sync",
    "bench.trace_overhead",  # reads the latency async_vs_sync calibrated
    "bench.memory",
    "bench.staleness_sweep",
    "bench.learning",
]


def main(argv: list[str] | None = None) -> int:
    names = argv if argv else BENCHMARKS
    failed = []
    for name in names:
        t0 = time.time()
        print(f"== {name}", flush=True)
        rc = subprocess.call([sys.executable, "-m", name])
        print(f"== {name}: rc={rc} in {time.time() - t0:.0f}s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
