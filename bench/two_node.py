"""Two Ray nodes on one machine, for real: the engine on one, the learner on the other.

Starts a two-node cluster with `ray.cluster_utils.Cluster` (two raylets and object stores on
127.0.0.1, custom resources `learner_node` on the head and `engine_node` on the second node), then
runs `streamrl train` against it (`RAY_ADDRESS`) with the only placement settings a multi-node user
writes: the engine asks for `engine_node`, the learner for `learner_node`. Nothing else changes
between one node and many: the weight-sync rendezvous address is found from the learner's node.

Checks, from the run directory: the run finished every step; `placement.json` puts the engine and
the learner on different nodes (the buffer on the driver's); every weight sync succeeded and the
engines serve the learner's final version. Writes `bench/results/two_node.json`.

    python -m bench.two_node [--steps 2] [--out bench/results/two_node.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import TRAIN_COMMAND
from streamrl.core.run_dir import RunDir, read_json
from streamrl.streaming.driver_state import DriverState

REPO = Path(__file__).resolve().parents[1]
# Every node of the simulated cluster is on 127.0.0.1. Ray resolves a loopback bootstrap address to
# the machine's outward IP unless its "no cluster networking" switch is set (the default on macOS
# and Windows): set it for this process and the job, so all of them talk over loopback.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def start_cluster() -> Any:
    os.environ.update(LOOPBACK_ENV)
    from ray.cluster_utils import Cluster

    common = {"node_ip_address": "127.0.0.1", "object_store_memory": 256 * 1024 * 1024, "num_cpus": 4}
    cluster = Cluster(
        initialize_head=True, head_node_args={**common, "resources": {"learner_node": 1.0}, "include_dashboard": False}
    )
    cluster.add_node(**common, resources={"engine_node": 1.0})
    cluster.wait_for_nodes()
    return cluster


def run_two_node(work: Path, *, steps: int, timeout_s: float = 900.0) -> dict[str, Any]:
    """Train `steps` steps over a fresh two-node cluster; returns what was checked (raises on a failure)."""
    cluster = start_cluster()
    try:
        run_dir = work / "two-node"
        cmd = [
            *TRAIN_COMMAND,
            "--config",
            "configs/tiny.toml",
            f"trainer.run_root={work}",
            "trainer.run_name=two-node",
            f"trainer.total_steps={steps}",
            f"trainer.checkpoint_every={steps}",
            "wandb.enabled=false",
            "rollout.engine.resources={engine_node = 1}",
            "learner.resources_per_worker={learner_node = 1}",
        ]
        env = {**os.environ, **LOOPBACK_ENV, "RAY_ADDRESS": cluster.address}
        started = time.monotonic()
        log = work / "train.log"
        with open(log, "w") as out:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        wall_s = time.monotonic() - started
        if proc.returncode != 0:
            raise RuntimeError(f"streamrl train exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        return check_run(run_dir, steps=steps, wall_s=wall_s)
    finally:
        cluster.shutdown()


def check_run(run_dir: Path, *, steps: int, wall_s: float) -> dict[str, Any]:
    run = RunDir(run_dir)
    placement = read_json(run.placement)
    nodes = placement["nodes"]
    by_resource = {
        res: nid for nid, node in nodes.items() for res in ("engine_node", "learner_node") if node["resources"].get(res)
    }
    steps_logged = [m for m in run.metric_records() if "learner/loss" in m]
    state = DriverState.load(run.driver_state)
    failed_syncs = sum(m.get("sync/num_failed", 0.0) for m in steps_logged)
    result = {
        "num_nodes": len(nodes),
        "engine_nodes": placement["engines"],
        "learner_nodes": placement["learner"],
        "buffer_node": placement["buffer"],
        "driver_node": placement["driver"],
        "rollout_worker_nodes": placement["rollout_workers"],
        "learner_step": state.learner_step,
        "policy_version": state.policy_version,
        "syncs_failed": failed_syncs,
        "engine_versions": [m.get("policy_version") for m in steps_logged],
        "wall_s": round(wall_s, 1),
    }
    problems = []
    if len(nodes) != 2:
        problems.append(f"{len(nodes)} nodes, not 2")
    if set(placement["engines"]) != {by_resource.get("engine_node")}:
        problems.append("the engine is not on the engine node")
    if set(placement["learner"]) != {by_resource.get("learner_node")}:
        problems.append("the learner is not on the learner node")
    if placement["buffer"] != placement["driver"]:
        problems.append("the buffer is not on the driver's node")
    if state.learner_step != steps or len(steps_logged) != steps:
        problems.append(f"{state.learner_step} learner steps, {len(steps_logged)} logged, not {steps}")
    if failed_syncs or state.policy_version != steps:
        problems.append(f"weight sync: {failed_syncs} failed, engines serve v{state.policy_version} not v{steps}")
    if problems:
        raise AssertionError("; ".join(problems) + f"\n{json.dumps(result, indent=1)}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench/results/two_node.json"))
    parser.add_argument("--keep", default=None, help="run here and keep the run directory and its log")
    args = parser.parse_args(argv)
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        result = run_two_node(Path(args.keep), steps=args.steps)
    else:
        with tempfile.TemporaryDirectory(prefix="streamrl-two-node-") as tmp:
            result = run_two_node(Path(tmp), steps=args.steps)
    out = {
        "command": f"python -m bench.two_node --steps {args.steps}",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "result": result,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
