"""LoRA against full fine-tuning: learner step time, peak memory, trainable state and weight-sync bytes.

    python -m bench.lora [--steps 3] [--rounds 1] [--settings full,lora8,lora32] [--model smollm2]
                         [--out bench/results/lora.json]

The learner is the one `configs/learning_smollm2.toml` builds (its `[learner]` table: one sequence per
micro-batch, activation checkpointing, a 128-token LM-head chunk, decoupled correction), with
`model` set by `--model` and, for a LoRA setting, `learner.lora.rank` set (alpha, targets and the
rest at their defaults: all seven projections). Its batch is that run's longest: one GRPO group of
`buffer.batch_size` = 4 rows sharing one `prompt_length` = 384-token prompt, each with a
`response_length` = 192-token response (a tool span masked out, as `bench.memory_learner.run_batch`
builds it), the same batch every step.

Settings: `full` (every weight trains), `lora<R>` (rank R, merged sync, the default) and
`lora<R>-adapter` (rank R, adapter sync). Each runs in a fresh child process (`--one SETTING`, with
the learner actor's environment: `core.memory.learner_runtime_env()`), so one setting's allocations
never count against another's. The child builds the engine, then runs one warm-up step and `--steps`
timed steps of `TrainingEngine.step`; after each step it prepares a publish as the learner does (the
tensors of `named_parameters_for_sync()` held at once, then the allocator trimmed), so the peak covers
the merged copy a merged publish holds. It reports:

- `step_s`: each timed step's seconds (the step alone, not the publish), and their median;
- `peak_rss_gb`: the child's resident high-water mark at its end (`getrusage(RUSAGE_SELF).ru_maxrss`):
  model load, every step and every publish; `rss_after_load_gb`, `rss_after_steps_gb` beside it;
- `trainable_params`, `total_params` and `optimizer_bytes` (AdamW's state tensors after the steps);
- `sync_bytes`: the bytes one weight sync sends per sync mode: `full` for full fine-tuning, `merged`
  and `adapter` for LoRA, each the payload of the buckets the transports plan
  (`weight_sync.buckets.plan_buckets` over `named_parameters_for_sync()`, in the run's wire dtype).

`--rounds R` runs every setting R times, round after round (a slow spell of a shared machine then
touches all settings); a setting's `step_s` pools its rounds and `peak_rss_gb` is the largest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/learning_smollm2.toml"
SETTINGS = ("full", "lora8", "lora32")
_SETTING = re.compile(r"^(full|lora(\d+)(-adapter)?)$")
_GB = 1024**3


def setting_overrides(setting: str, model: str) -> list[str]:
    """Run-file overrides of one setting (module doc); ValueError for a name that is none."""
    match = _SETTING.match(setting)
    if match is None:
        raise ValueError(f"unknown setting {setting!r}: full, lora<R> or lora<R>-adapter (e.g. lora8, lora32-adapter)")
    overrides = [f"model={model}"]
    if match.group(2) is not None:
        overrides.append(f"learner.lora.rank={int(match.group(2))}")
        overrides.append(f"learner.lora.sync={'adapter' if match.group(3) else 'merged'}")
    return overrides


def sync_bytes(engine: Any, weight_sync: Any) -> dict[str, dict[str, int]]:
    """Per sync mode (`full`; or `merged` and `adapter` with LoRA): `bytes`, the payload one sync sends
    (the tensors `named_parameters_for_sync()` yields, in the wire dtype `weight_sync` gives them, as
    `plan_buckets` lays them out for the transports), `buffer_bytes` (the buckets with their slot
    alignment) and `num_tensors`. With LoRA each mode is read with `learner.lora.sync` set to it; the
    engine's own mode is restored after."""
    from streamrl.learner.config import LoraSync
    from streamrl.weight_sync.buckets import plan_buckets

    def measure() -> dict[str, int]:
        tensors = list(engine.named_parameters_for_sync())
        buckets = plan_buckets(
            tensors, weight_sync.bucket_bytes, weight_sync.zero_copy_bytes, weight_sync.wire_torch_dtype
        )
        return {
            "bytes": sum(meta.nbytes for bucket in buckets for meta in bucket.tensors),
            "buffer_bytes": sum(bucket.nbytes for bucket in buckets),
            "num_tensors": len(tensors),
        }

    lora = engine.cfg.lora
    if lora is None:
        return {"full": measure()}
    own = lora.sync
    try:
        out = {}
        for mode in (LoraSync.MERGED, LoraSync.ADAPTER):
            lora.sync = mode
            out[mode.value] = measure()
        return out
    finally:
        lora.sync = own


def optimizer_bytes(engine: Any) -> int:
    """Bytes of the optimiser's state tensors (AdamW: exp_avg, exp_avg_sq and the step counters)."""
    return sum(
        value.numel() * value.element_size()
        for state in engine.optimizer.state.values()
        for value in state.values()
        if hasattr(value, "element_size")
    )


def group_batch(cfg: Any, vocab: int, policy_version: int) -> Any:
    """The run's longest batch (`bench.memory_learner.run_batch`, seed 0) with row 0's prompt in every
    row, as a GRPO group has it; behaviour tokens one version stale."""
    from bench.memory_learner import run_batch

    batch = run_batch(cfg, vocab, 0, policy_version, longest=True)
    prompt = int(batch.prompt_lens[0])
    assert (batch.prompt_lens == prompt).all(), "the longest batch has one prompt length"
    batch.input_ids[:, :prompt] = batch.input_ids[0, :prompt]
    return batch


def run_one(setting: str, model: str, steps: int) -> dict[str, Any]:
    """One setting in this process (module doc): its step times, memory, state and sync bytes."""
    import torch

    from bench.machine import cpu_pressure
    from streamrl.core.memory import rss_gb, trim_allocator
    from streamrl.learner.engine import TrainingEngine
    from streamrl.streaming.config import load_config

    cfg = load_config(REPO / CONFIG, setting_overrides(setting, model))
    engine = TrainingEngine(cfg.learner)
    trim_allocator()
    rss_after_load = rss_gb()
    vocab = engine.policy.lm.config.vocab_size
    times, pressure = [], []
    for i in range(steps + 1):  # step 0 warms up
        batch = group_batch(cfg, vocab, engine.policy_version)
        pressure.append(cpu_pressure())
        start = time.perf_counter()
        engine.step(batch)
        elapsed = time.perf_counter() - start
        trim_allocator()  # as the learner's end_of_step
        publish = list(engine.named_parameters_for_sync())  # what a publish holds while it sends
        del publish
        trim_allocator()  # as the learner's publish, after it
        if i > 0:
            times.append(elapsed)
        print(json.dumps({"setting": setting, "step": i, "step_s": elapsed}), file=sys.stderr, flush=True)
    params = list(engine.policy.parameters())
    lora = cfg.learner.lora
    return {
        "setting": setting,
        "model": model,
        "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "sync": lora.sync.value},
        "tokens": int(batch.attention_mask.sum()),
        "torch_threads": torch.get_num_threads(),
        "step_s": times,
        "cpu_pressure_before_step": pressure,
        "rss_after_load_gb": rss_after_load,
        "rss_after_steps_gb": rss_gb(),
        # Linux reports ru_maxrss in KiB: the high-water mark of the whole process, load included
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GB,
        "total_params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "optimizer_bytes": optimizer_bytes(engine),
        "sync_bytes": sync_bytes(engine, cfg.weight_sync),
        "wire_dtype": cfg.weight_sync.wire_dtype,
    }


def spawn(setting: str, model: str, steps: int, timeout_s: float) -> dict[str, Any]:
    """`run_one` in a fresh interpreter with the learner actor's environment (threads, allocator)."""
    from streamrl.core.memory import learner_runtime_env

    env = os.environ | learner_runtime_env()
    cmd = [sys.executable, "-m", "bench.lora", "--one", setting, "--model", model, "--steps", str(steps)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout_s, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's rounds as one record: step times pooled, the largest peak."""
    first = runs[0]
    steps = [s for run in runs for s in run["step_s"]]
    keep = (
        "lora",
        "tokens",
        "torch_threads",
        "total_params",
        "trainable_params",
        "optimizer_bytes",
        "sync_bytes",
        "wire_dtype",
    )
    return {
        **{key: first[key] for key in keep},
        "step_s_median": statistics.median(steps),
        "step_s": steps,
        "peak_rss_gb": max(run["peak_rss_gb"] for run in runs),
        "peak_rss_gb_per_round": [run["peak_rss_gb"] for run in runs],
        "rss_after_load_gb": [run["rss_after_load_gb"] for run in runs],
        "rss_after_steps_gb": [run["rss_after_steps_gb"] for run in runs],
        "cpu_pressure_before_step": [run["cpu_pressure_before_step"] for run in runs],
    }


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "commit_dirty": bool(git("status", "--porcelain"))}


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting, after one warm-up step")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every setting, round after round")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help="full, lora<R>, lora<R>-adapter, comma-separated"
    )
    parser.add_argument("--model", default="smollm2", help="tiny: a quick check of the script")
    parser.add_argument("--out", default="bench/results/lora.json")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per setting and round")
    parser.add_argument("--one", metavar="SETTING", help="run one setting in this process, print its JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    if args.one:
        print(json.dumps(run_one(args.one, args.model, args.steps)))
        return 0
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for setting in settings:
        setting_overrides(setting, args.model)  # a bad name fails before any child starts
    t0 = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for setting in settings:
            runs[setting].append(spawn(setting, args.model, args.steps, args.timeout_s))
    result = {
        "command": "python -m bench.lora " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        **git_commit(),
        "config": CONFIG,
        "model": args.model,
        "steps": args.steps,
        "rounds": args.rounds,
        "settings": {setting: summarise(values) for setting, values in runs.items()},
        "wall_s": time.monotonic() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for setting, v in result["settings"].items():
        sync = ", ".join(f"{mode} {b['bytes'] / 1e6:.1f} MB" for mode, b in v["sync_bytes"].items())
        print(
            f"{setting}: {v['step_s_median']:.2f} s/step, peak RSS {v['peak_rss_gb']:.2f} GiB, "
            f"{v['trainable_params'] / 1e6:.2f}M trainable, AdamW {v['optimizer_bytes'] / 1e6:.1f} MB, sync {sync}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
