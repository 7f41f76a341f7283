"""`make gpu-check`: the GPU paths, exercised for real on a machine with CUDA.

One short async `streamrl train` (tiny model) with every part on CUDA: the vLLM CUDA engine
(token-in/token-out, bf16, aborted and resumed by each weight sync in abort mode), the weight sync
with checksums into it (NCCL with 2+ GPUs; gloo when the engine and the learner share the only GPU,
since NCCL refuses two processes on one GPU), and an FSDP2 learner group of one rank per GPU left
after the engine. Checked
from the run directory: every step ran, every sync succeeded, the engines serve the learner's last
version, the learner group has the ranks asked for and reports CUDA memory. Writes
`bench/results/gpu.json` (versions, timings, pass/fail per check).

Without CUDA it stops at that check: exit 2 and a JSON that says so; `--dry-run` instead resolves the
GPU config and prints its memory estimate (`streamrl train --dry-run`), which runs anywhere.

    python -m bench.gpu_check [--steps 3] [--dry-run] [--out bench/results/gpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def environment() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"platform": platform.platform(), "torch": torch.__version__,
                           "cuda": torch.cuda.is_available(), "num_gpus": torch.cuda.device_count()}
    if out["cuda"]:
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(out["num_gpus"])]
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except ImportError as exc:
        out["vllm"] = f"not importable: {exc}"
    return out


def gpu_overrides(work: Path, *, steps: int, num_gpus: int) -> list[str]:
    """Engine on GPU 0, learner ranks on the rest. With a single GPU the engine and the one learner
    rank share it, and the weight sync goes over gloo: NCCL refuses two processes on one GPU
    ("Duplicate GPU detected", seen on an H100), and the config refuses that combination."""
    ranks = max(num_gpus - 1, 1)
    shared = num_gpus == 1
    return [
        f"trainer.run_root={work}", "trainer.run_name=gpu-check", f"trainer.total_steps={steps}",
        f"trainer.checkpoint_every={steps}", "wandb.enabled=false",
        "rollout.engine.device=cuda", "rollout.engine.dtype=bfloat16",
        "rollout.engine.num_gpus=0.5" if shared else "rollout.engine.num_gpus=1",
        f"rollout.engine.gpu_memory_utilization={0.3 if shared else 0.85}",
        "learner.device=cuda", f"learner.num_workers={ranks}",
        *(["learner.num_gpus_per_worker=0.5"] if shared else []),
        f"weight_sync.backend={'gloo' if shared else 'nccl'}", "weight_sync.pause_mode=abort",
    ]


def load_logged(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step learner rows of the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [m for m in rows if "learner/loss" in m]


def check_run(run_dir: Path, *, steps: int, ranks: int) -> dict[str, bool]:
    logged = load_logged(run_dir)
    state = json.loads((run_dir / "driver_state.json").read_text())
    return {
        "every step ran": state["learner_step"] == steps and len(logged) == steps,
        "every sync succeeded": all(m.get("sync/num_failed", 0.0) == 0.0 for m in logged),
        "engines serve the last version": state["policy_version"] == steps,
        "learner group has every rank": all(m.get("learner/num_workers") == float(ranks) for m in logged),
        "learner reports CUDA memory": all(m.get("memory/learner_peak_gb", 0.0) > 0.0 for m in logged),
        # the bf16 CUDA engine's sampled log-probs against the learner's recomputation (staleness included)
        "behaviour log-probs agree with the learner's": all(m.get("is/mismatch_kl", 1.0) < 1e-2 for m in logged),
        "report written": (run_dir / "report.html").exists(),
    }


def observed(run_dir: Path) -> dict[str, Any]:
    """What the run measured, per step: weight-sync bytes and pause, IS-ratio range, GPU memory."""
    keys = ["sync/bytes", "sync/paused_s", "is/ratio_min", "is/ratio_max", "is/mismatch_kl", "learner/step_s",
            "memory/learner_peak_gb", "memory/engine_peak_gb"]
    return {key: [m.get(key) for m in load_logged(run_dir)] for key in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="resolve the GPU config and its memory estimate only")
    parser.add_argument("--out", default=str(REPO / "bench/results/gpu.json"))
    args = parser.parse_args(argv)
    env = environment()
    num_gpus = env["num_gpus"]
    out: dict[str, Any] = {"command": "python -m bench.gpu_check" + (" --dry-run" if args.dry_run else ""),
                           "environment": env}
    with tempfile.TemporaryDirectory(prefix="streamrl-gpu-check-") as tmp:
        overrides = gpu_overrides(Path(tmp), steps=args.steps, num_gpus=max(num_gpus, 1))
        out["overrides"] = overrides
        base = [sys.executable, "-m", "streamrl.streaming.cli", "train", "--config", "configs/tiny.toml"]
        if args.dry_run:
            proc = subprocess.run([*base, "--dry-run", *overrides], cwd=REPO, capture_output=True, text=True)
            print(proc.stdout or proc.stderr)
            return proc.returncode
        if not env["cuda"]:
            out["checks"] = {"CUDA available": False}
            out["note"] = "no CUDA device here: stopped at the CUDA check (use --dry-run to check the config)"
            print(json.dumps(out, indent=1))
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
            return 2
        log = Path(tmp) / "train.log"
        started = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.run([*base, *overrides], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=1800)
        out["wall_s"] = round(time.monotonic() - started, 1)
        out["exit_code"] = proc.returncode
        checks = {"CUDA available": True, "train exited 0": proc.returncode == 0}
        if proc.returncode == 0:
            checks.update(check_run(Path(tmp) / "gpu-check", steps=args.steps, ranks=max(num_gpus - 1, 1)))
            out["observed"] = observed(Path(tmp) / "gpu-check")
        else:
            out["log_tail"] = log.read_text()[-4000:]
        out["checks"] = checks
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
