"""Sandbox escape benchmark: the code-interpreter tool against the escape catalogue.

    python -m bench.sandbox [--isolation auto] [--bwrap PATH] [--out bench/results/sandbox.json]

Runs every attempt of `workloads/tools/sandbox_escapes.py` (network, files outside the workdir, env
secrets, killing the parent, fork/memory/output/disk bombs, infinite loops, regaining privileges)
through `CodeInterpreterTool.execute` with the layer the start-up probe picks, and records for each
whether it was blocked (judged from outside the sandbox where the effect is observable there), the
observation the model got, the layer that stopped it and the wall time. A control run repeats the
attempts that are safe without namespaces under `isolation = "none"`, to show the checks do catch
escapes. `--bwrap` also runs the catalogue under a bwrap binary outside PATH. The per-call overhead
(a trivial cell) of each layer is measured too.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.machine import machine
from streamrl.tools.code_interpreter import CodeInterpreterTool
from streamrl.workloads.tools.sandbox_escapes import (
    ATTEMPTS,
    Harness,
    escape_tool_config,
    run_attempt,
)

LAYERS = {
    "user namespace": "no capabilities (bounding set dropped, securebits, no_new_privs); an unprivileged uid "
    "when the trainer is root; no nested user namespaces",
    "mount namespace": "new tmpfs root with only system dirs and the interpreter, read-only; private "
    "/workspace and /tmp; no home, repository, host /tmp",
    "network namespace": "only a down loopback: no host or internet connections",
    "pid namespace": "host processes invisible and unkillable; everything dies with the sandbox's init",
    "rlimits": "AS (memory), CPU, FSIZE, NOFILE, NPROC, CORE=0",
    "wall timeout": "SIGALRM for the cell, SIGKILL of the whole process group as backstop",
    "output cap": "head + tail kept, middle cut; a stream past 4 MiB kills the program",
    "cleared environment": "the program's environment is built from scratch (no API keys)",
}


async def overhead_ms(tool: CodeInterpreterTool, repeats: int = 10) -> dict[str, float]:
    """Wall time of a trivial cell (sandbox start-up + interpreter start)."""
    times = []
    instance = await tool.create()
    for _ in range(repeats):
        start = time.perf_counter()
        await tool.execute(instance, {"code": "1"})
        times.append((time.perf_counter() - start) * 1000)
        tool.instance_state(instance)["cells"].clear()  # measure a first cell every time
    await tool.release(instance)
    return {"median": round(statistics.median(times), 1), "max": round(max(times), 1)}


async def run_catalogue(tool: CodeInterpreterTool, harness: Harness, *, namespaced: bool) -> dict[str, Any]:
    outcomes = []
    for attempt in ATTEMPTS:
        if attempt.namespaced_only and not namespaced:
            continue
        outcome = await run_attempt(tool, attempt, harness)
        outcomes.append(outcome)
        print(
            f"{tool.layer:8s} {outcome.name:32s} blocked={outcome.blocked!s:5s} "
            f"{outcome.wall_s:5.2f}s  {outcome.layer}",
            flush=True,
        )
    return {
        "layer": tool.layer,
        "probe": tool.sandbox.report.tried,
        "attempts_tried": len(outcomes),
        "attempts_blocked": sum(o.blocked for o in outcomes),
        "error_observations": sum(o.error_observation for o in outcomes),
        "overhead_ms": await overhead_ms(tool),
        "attempts": [_row(o) for o in outcomes],
    }


def _row(outcome: Any) -> dict[str, Any]:
    row = asdict(outcome)
    row["wall_s"] = round(row["wall_s"], 3)
    row["metrics"] = {k: round(v, 3) for k, v in row["metrics"].items()}
    return row


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    with Harness() as harness:
        tool = CodeInterpreterTool(escape_tool_config(harness, isolation=args.isolation))
        main_run = await run_catalogue(tool, harness, namespaced=tool.layer != "none")
        control = await run_catalogue(
            CodeInterpreterTool(escape_tool_config(harness, isolation="none")), harness, namespaced=False
        )
        others = {}
        if args.bwrap:
            bwrap = CodeInterpreterTool(escape_tool_config(harness, isolation="bwrap", bwrap_path=args.bwrap))
            version = subprocess.run([args.bwrap, "--version"], capture_output=True, text=True).stdout.strip()
            others["bwrap"] = {
                "binary": args.bwrap,
                "version": version,
                **await run_catalogue(bwrap, harness, namespaced=True),
            }
        config = escape_tool_config(harness, isolation=args.isolation)
    config.pop("ro_paths")
    return {
        "isolation": {"requested": args.isolation, "chosen": main_run["layer"], "probe": main_run["probe"]},
        "attempts_tried": main_run["attempts_tried"],
        "attempts_blocked": main_run["attempts_blocked"],
        "all_blocked": main_run["attempts_tried"] == main_run["attempts_blocked"],
        "config": config,
        "layers": LAYERS,
        "run": main_run,
        "control_without_isolation": control,
        "other_layers": others,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "unshare"])
    parser.add_argument("--bwrap", default=None, help="also run the catalogue under this bwrap binary")
    parser.add_argument("--out", default="bench/results/sandbox.json")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    result = {
        "command": " ".join(["python -m bench.sandbox", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(euid=os.geteuid()),
        **asyncio.run(bench(args)),
    }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k] for k in ("isolation", "attempts_tried", "attempts_blocked", "all_blocked")}
    summary["control_blocked"] = (
        f"{result['control_without_isolation']['attempts_blocked']}/{result['control_without_isolation']['attempts_tried']}"
    )
    print(json.dumps(summary, indent=1))
    return 0 if result["all_blocked"] else 1


if __name__ == "__main__":
    sys.exit(main())
