"""Memory of the default run, part by part, and of the learner's logits path before/after chunking.

    python -m bench.memory [--steps 6] [--seeds 3] [--keep DIR] [--out bench/results/memory.json]

1. Runs `streamrl train --config configs/default.toml trainer.total_steps=N` (this checkout, its
   cache) while sampling every process of the job (`bench/memsample.py`): peak RSS of the driver,
   the engine, the learner, the rollout worker, the buffer, and the node peak (their sum).
2. Runs `bench.memory_learner` (one learner train step on the same synthetic default-shaped batch,
   full [B, T, V] logits vs the chunked LM head, each in a fresh process, several seeds) and embeds
   its result.
Targets: node peak <= 12 GB; learner peak <= 1.5 x (params + grads + AdamW states).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from bench import TRAIN_COMMAND
from bench.memsample import sample_run
from streamrl.core.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_PARAMS = 134_515_008


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(REPO / "bench/results/memory.json"))
    parser.add_argument("--skip-logits", action="store_true")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the logits-path comparison")
    parser.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="run the job under DIR and keep its run directory (DIR/memory), e.g. for `streamrl staleness`",
    )
    args = parser.parse_args(argv)
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    keep = contextlib.nullcontext(str(Path(args.keep).resolve())) if args.keep else None
    with keep or tempfile.TemporaryDirectory(prefix="streamrl-memory-") as tmp:
        cmd = [
            *TRAIN_COMMAND,
            "--config",
            "configs/default.toml",
            f"trainer.total_steps={args.steps}",
            f"trainer.run_root={tmp}",
            "trainer.run_name=memory",
        ]
        rc, wall, memory = sample_run(
            cmd, cwd=str(REPO), env=dict(os.environ), log_path=f"{tmp}/train.log", timeout_s=3600
        )
        run = RunDir(Path(tmp) / "memory")
        lines = run.metric_records() if run.metrics.exists() else []
        metrics = [m for m in lines if "learner/loss" in m]  # the learner steps (not held-out evaluations)
    state_gb = 16 * SMOLLM2_PARAMS / 2**30  # fp32 params + grads + AdamW m and v
    learner = memory["part_peak_gb"].get("learner", 0.0)
    result = {
        "command": "python -m bench.memory " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        },
        "run": {
            "exit_code": rc,
            "wall_s": round(wall, 1),
            "steps": len(metrics),
            **memory,
            "learner_rss_per_step_gb": [round(m.get("memory/learner_rss_gb", 0.0), 3) for m in metrics],
            "learner_peak_gb_reported": max((m.get("memory/learner_peak_gb", 0.0) for m in metrics), default=None),
            "reward_per_step": [m.get("rollout/reward_mean") for m in metrics],
            "sync_paused_s": [m.get("sync/paused_s") for m in metrics],
        },
        "learner_state_gb": round(state_gb, 3),
        "learner_peak_over_state": round(learner / state_gb, 2),
        "targets": {"node_peak_gb_max": 12, "learner_peak_over_state_max": 1.5},
    }
    if not args.skip_logits:
        out = Path(tempfile.mkdtemp()) / "logits.json"
        subprocess.run(
            [sys.executable, "-m", "bench.memory_learner", "--seeds", str(args.seeds), "--out", str(out)],
            cwd=REPO,
            check=False,
        )
        result["logits_path"] = json.loads(out.read_text()) if out.exists() else None
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
