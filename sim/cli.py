"""The simulator's commands, registered on the `streamrl` parser (`streaming.cli`):

streamrl plan --model 7B --gpus 256 --tool-latency p50=2s,p99=60s   (recommended split, busy, lag, throughput)
streamrl calibrate RUN_DIR [RUN_DIR ...] [--out FILE]                (fit the costs, then predict each run)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _verdict(row: dict[str, Any]) -> str:
    if row["within"]:
        return "ok"
    return "OFF (within the noise)" if row.get("within_noise") else "OFF"


def _calibrate(args: argparse.Namespace) -> int:
    from streamrl.sim.calibrate import calibrate, sim_config_of
    from streamrl.sim.costs import ToolLatency
    from streamrl.sim.observe import from_metrics
    from streamrl.sim.validate import compare, measured, predicted

    tool = ToolLatency.parse(args.tool_latency) if args.tool_latency else None
    costs = calibrate(args.run_dirs, tool=tool)
    print(json.dumps({k: v for k, v in costs.to_json().items() if k != "source"}, indent=1))
    report: dict[str, Any] = {"costs": costs.to_json(), "runs": {}}
    for run_dir in args.run_dirs:
        obs = from_metrics(run_dir)
        rows = compare(measured(obs), predicted(sim_config_of(obs), costs))
        report["runs"][str(run_dir)] = rows
        print(f"{run_dir} ({obs.mode}):")
        for key, row in rows.items():
            if key == "lag_hist":
                print(f"  {key:<26} max bin difference {row['max_bin_diff']:.3f} {'ok' if row['within'] else 'OFF'}")
            else:
                print(
                    f"  {key:<26} measured {row['measured']:>10.4g} predicted {row['predicted']:>10.4g} "
                    f"({100 * row['rel_error']:+.1f} %) {_verdict(row)}"
                )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from streamrl.sim.plan import plan_main

    return plan_main(args)


def register(sub: Any) -> None:
    """Add `plan` and `calibrate` to the `streamrl` subcommands."""
    from streamrl.sim.published import MODELS

    p = sub.add_parser("plan", help="recommended engine:learner split, busy share, lag and throughput (simulated)")
    p.add_argument("--model", required=True, choices=sorted(MODELS), help="7B, 32B (dense) or 235B (MoE)")
    p.add_argument("--gpus", type=int, required=True, help="H100 GPUs in the cluster")
    p.add_argument("--tool-latency", default="p50=2s,p99=60s", help="p50=<t>,p99=<t>[,max=<t> timeout]")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--no-overlap", action="store_true", help="engines pause for the whole weight transfer")
    p.add_argument("--steps", type=int, default=12, help="simulated learner steps per configuration")
    p.add_argument("--batch", type=int, help="trajectories per learner step (default 32 per GPU)")
    p.add_argument(
        "--correction",
        default="decoupled",
        help="the staleness correction whose measured cost of lag prices async's steps (staleness lab)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_plan)

    c = sub.add_parser("calibrate", help="fit the simulator's costs to runs of this machine and predict each run")
    c.add_argument("run_dirs", nargs="+", help="run directories (an async and a sync run of one workload fit best)")
    c.add_argument("--tool-latency", help="p50=<t>,p99=<t> (default: the run's latency environment)")
    c.add_argument("--out", help="write the costs and the comparison as JSON")
    c.set_defaults(func=_calibrate)
