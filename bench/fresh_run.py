"""What a newcomer sees: clone main into a temp dir, `make install` then `make run` there with an empty
project cache (no venv, nothing in `.cache/`), and record install and run time separately, the exit
code, the final learner step, the reward per step, per-part and node peak memory, and whether
`report.html` was written. Writes bench/results/fresh_run.json.

    python -m bench.fresh_run [--ref main] [--out bench/results/fresh_run.json]

The pip download cache (~/.cache/pip) is the machine's: as on CI, packages are not re-downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.memsample import sample_run
from streamrl.core.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]


def _metrics(run_dir: Path) -> list[dict]:
    run = RunDir(run_dir)
    return run.metric_records() if run.metrics.exists() else []


def _heldout_comparison(run_dir: Path) -> dict | None:
    """The paired test of the run's first and last held-out evaluation (streaming.heldout)."""
    from streamrl.streaming.heldout import first_last_comparison

    found = first_last_comparison(run_dir)
    if found is None:
        return None
    first, last, result = found
    return {
        "first_step": first,
        "last_step": last,
        "before": round(result.before, 4),
        "after": round(result.after, 4),
        "ci95": [round(result.ci_low, 4), round(result.ci_high, 4)],
        "p_value": result.p_value,
        "test": result.test,
        "num_pairs": result.num_pairs,
        "num_up": result.num_up,
        "num_down": result.num_down,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default="HEAD")
    parser.add_argument("--out", default=str(REPO / "bench/results/fresh_run.json"))
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--keep", action="store_true", help="keep the clone")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="streamrl-fresh-"))
    clone = tmp / "main"
    commit = subprocess.run(
        ["git", "rev-parse", args.ref], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
    if (REPO.parent / "shared").exists():
        os.symlink(REPO.parent / "shared", tmp / "shared")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMRL_", "VIRTUAL_ENV", "RAY_"))}
    log = tmp / "make.log"
    t0 = time.monotonic()
    install = subprocess.run(["make", "install"], cwd=clone, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    install_s = time.monotonic() - t0
    rc, run_s, memory = sample_run(
        ["make", "run"], cwd=str(clone), env=env, log_path=str(log), timeout_s=args.timeout_s
    )
    runs = sorted((clone / "runs").glob("*")) if (clone / "runs").exists() else []
    run_dir = runs[-1] if runs else None
    lines = _metrics(run_dir) if run_dir else []
    steps = [m for m in lines if "learner/loss" in m]  # one per learner step (held-out evaluations apart)
    heldout = [
        {
            "learner_step": m["learner_step"],
            "reward": round(m["eval/reward_mean"], 3),
            "num_prompts": m["eval/num_prompts"],
            "seconds": round(m["eval/seconds"], 1),
        }
        for m in lines
        if "eval/reward_mean" in m
    ]
    rewards = [round(m.get("rollout/finished_reward_mean", float("nan")), 3) for m in steps]
    summary_lines = [
        ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip().startswith("held-out")
    ]
    comparison = _heldout_comparison(run_dir) if run_dir else None
    half = len(rewards) // 2
    result = {
        "command": "python -m bench.fresh_run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        },
        "install_exit_code": install.returncode,
        "install_s": round(install_s, 1),
        "run_exit_code": rc,
        "run_s": round(run_s, 1),
        "final_step": steps[-1]["learner_step"] if steps else 0,
        "reward_per_step": rewards,
        "reward_first_half_mean": round(sum(rewards[:half]) / max(half, 1), 3) if half else None,
        "reward_second_half_mean": round(sum(rewards[half:]) / max(len(rewards) - half, 1), 3) if half else None,
        "heldout_reward": heldout,
        "heldout_summary_line": summary_lines[-1] if summary_lines else None,  # what `make run` printed last
        "heldout_comparison": comparison,
        "memory": memory,
        "learner_peak_gb_reported": max((m.get("memory/learner_peak_gb", 0.0) for m in steps), default=None),
        "report_html": bool(run_dir and RunDir(run_dir).report.exists()),
        "checkpoints": [c.name for c in RunDir(run_dir).checkpoint_folders()] if run_dir else [],
        "log_tail": log.read_text(errors="replace")[-3000:],
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, indent=1))
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
