"""On-policy distillation benchmark: does a student trained only on a better teacher's per-token
reverse KL rise on held-out prompts? (docs/distillation.md)

The student is SmolLM2-135M with no task reward in its advantage (`distill.mode = "kl"`; the
reward filter off, since a group of equal rewards still has the teacher's signal), as converted or,
with `--sft true`, after the run file's SFT warm-up on the tool-call format (held-out ≈ 0.01, where
RL starts); the teacher is a given checkpoint folder of the same tokenizer, e.g. the `hf/` folder of
a `make run` or `make learn-bench` run's last checkpoint. Each seed runs `streamrl train` on
`configs/learning_smollm2.toml` with `[distill]` on and a checkpoint every `--eval-every` steps;
`streamrl eval` then scores the base model and every checkpoint on the same held-out prompts
(greedy, one engine, after the run).

Reported (bench/results/distill.json): per seed the held-out curve against step and wall time, the
`distill/*` metrics of every step (KL to the teacher, teacher latency), and pooled over seeds as
(seed, prompt) pairs the rise from the base model to the last checkpoint with its paired test (exact
McNemar on 0/1 rewards, else a sign-flip permutation test) and a bootstrap interval.

    python -m bench.distill --teacher RUN/checkpoints/step_000010/hf [--seeds 0 1 2] [--steps 10]
                            [--eval-every 5] [--mode kl|mixed] [--coef 1.0] [key=value ...]

A dry run of the whole pipeline on the tiny model (teacher = the student's own weights, so the KL
stays 0 and nothing should rise; minutes on 2 cores):

    python -m bench.distill --teacher tiny --model tiny --config configs/tiny.toml --sft false \\
        --steps 2 --eval-every 1 --eval-prompts 8 --out /tmp/distill_dry.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.learning import REPO, curve, eval_prompts, evaluate_offline, pooled, train
from bench.machine import machine
from streamrl.core.run_dir import RunDir

CONFIG = "configs/learning_smollm2.toml"
OUT = REPO / "bench/results/distill.json"


def distill_overrides(args: argparse.Namespace) -> list[str]:
    """The run's overrides: the student, no warm-up unless asked, the teacher and its signal."""
    return [
        f"model={args.model}",
        f"sft.enabled={str(args.sft).lower()}",
        f"distill.teacher={args.teacher}",
        f"distill.mode={args.mode}",
        f"distill.coef={args.coef}",
        # the teacher's signal alone: a group whose task rewards are all equal still has one to learn from
        *(["buffer.filter_uniform_reward_groups=false"] if args.mode == "kl" else []),
        *args.overrides,
    ]


def distill_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The `distill/*` values of every metrics line that has them, with its learner step."""
    out = []
    for row in RunDir(run_dir).metric_records():
        values = {k: float(v) for k, v in row.items() if k.startswith("distill/")}
        if values:
            out.append({"learner_step": float(row["learner_step"]), **values})
    return out


def run_seed(args: argparse.Namespace, seed: int, root: Path, num_prompts: int, log: Path) -> dict[str, Any]:
    run_dir, wall_s, rc = train(
        args.config, "async", seed, root, args.steps, args.eval_every, distill_overrides(args), log
    )
    record: dict[str, Any] = {"seed": seed, "run_dir": str(run_dir), "wall_s": wall_s, "exit_code": rc}
    if rc == 0:
        record["eval_exit_code"] = evaluate_offline(run_dir, num_prompts, log)
        record["curve"] = curve(run_dir)
        record["distill"] = distill_metrics(run_dir)
    return record


def merged_runs(path: Path, seeds: set[int]) -> list[dict[str, Any]]:
    """The runs of an earlier result JSON of seeds not in `seeds`, each marked with the commit and
    command it came from."""
    earlier = json.loads(path.read_text())
    source = {"commit": earlier.get("commit"), "command": earlier["command"]}
    return [r | {"merged_from": r.get("merged_from", source)} for r in earlier["runs"] if r["seed"] not in seeds]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pooled rise from the base model to the last checkpoint, with its paired test."""
    from streamrl.streaming.eval_stats import compare

    done = [r for r in runs if r["exit_code"] == 0 and len(r.get("curve", [])) >= 2]
    if not done:
        return {"num_seeds": 0}
    result = compare(pooled(done, 0), pooled(done, -1))
    kls = [d["distill/kl_mean"] for r in done for d in r["distill"] if "distill/kl_mean" in d]
    latency = [
        d["distill/teacher_latency_mean_s"] for r in done for d in r["distill"] if "distill/teacher_latency_mean_s" in d
    ]
    return {
        "num_seeds": len(done),
        **result.record(),
        "kl_first_step": kls[0] if kls else None,
        "kl_last_step": kls[-1] if kls else None,
        "teacher_latency_mean_s": statistics.fmean(latency) if latency else None,
        "wall_s_mean": statistics.fmean(r["wall_s"] for r in done),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True, help="the teacher: a HF folder (a checkpoint's hf/) or a built-in")
    parser.add_argument("--model", default="smollm2", help="the student (default: SmolLM2-135M as converted)")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--sft", type=lambda s: s.lower() == "true", default=False, help="warm the student up first")
    parser.add_argument("--mode", choices=["kl", "mixed"], default="kl")
    parser.add_argument("--coef", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=None, help="default: the config's eval.num_prompts")
    parser.add_argument("--root", default=None, help="where the runs go (default: a fresh temporary folder)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--merge", default=None, help="an earlier result JSON whose runs of other seeds join these")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    num_prompts = args.eval_prompts or eval_prompts(args.config)
    if num_prompts <= 0:
        raise SystemExit("no held-out prompts: set eval.num_prompts in the config or --eval-prompts")
    root = Path(args.root or tempfile.mkdtemp(prefix="streamrl-distill-"))
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    started = time.time()
    runs = [run_seed(args, seed, root, num_prompts, log) for seed in args.seeds]
    if args.merge:
        runs = merged_runs(Path(args.merge), {r["seed"] for r in runs}) + runs
    result = {
        "benchmark": "distill",
        "command": "python -m bench.distill " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
        "machine": machine(),
        "config": args.config,
        "student": args.model,
        "teacher": args.teacher,
        "mode": args.mode,
        "coef": args.coef,
        "steps": args.steps,
        "eval_prompts": num_prompts,
        "started_at": started,
        "summary": summarize(runs),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
