"""Learner memory benchmark: peak of one train step with and without chunked logits, and RSS across steps.

    python -m bench.memory_learner [--config configs/default.toml] [--seeds 3] [--steps 50]
                                   [--skip-chunks] [--growth-variants before,after]
                                   [--out bench/results/memory_learner.json]

The learner of the run file (SmolLM2-135M for configs/default.toml) gets synthetic batches shaped
like that run's: `buffer.batch_size` sequences in groups of `buffer.group_size`, prompts up to
`rollout.agent.prompt_length` and responses up to `response_length` tokens, one-version-stale
behaviour log-probs. Every measurement runs in a fresh subprocess, so VmHWM (peak RSS) covers
only that variant:

- chunks: the peak of `--chunk-steps` train steps (the second one holds AdamW's moments too) on the
  longest possible batch, for `--seeds` seeds, with `learner.logits_chunk_tokens = 0` (one
  [B, T, V] logits tensor per micro-batch), with the configured chunk size, and with that chunk
  size plus `learner.gradient_checkpointing`; allocator settings and trim on in all three;
- growth (with `--steps N > 0`): N steps on batches of varying lengths, RSS after each step, once
  with every memory measure off (no chunking, no activation checkpointing, no allocator settings, no
  trim) and once as the learner runs now (the run file + `--override`s,
  `core.memory.learner_runtime_env()` in the environment, `trim_allocator()` after each step);
  `--growth-variants after` runs only the latter.

`learner_memory()` returns the result dict (bench/memory.py folds it into its report).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_MALLOC_VARS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def run_batch(cfg: Any, vocab: int, seed: int, policy_version: int, *, longest: bool) -> SimpleNamespace:
    """A `PaddedBatch`-like batch shaped like the run's: `longest` gives every row the full prompt and
    response; otherwise prompts take 60-100% and responses 30-100% of their budgets (as real
    batches vary, which is what fragments an allocator). A tool-output span inside each response is
    masked out, as in multi-turn trajectories."""
    rng = np.random.default_rng(seed)
    batch, group = cfg.buffer.batch_size, cfg.buffer.group_size
    max_prompt, max_resp = cfg.rollout.agent.prompt_length, cfg.rollout.agent.response_length
    if longest:
        prompts, resps = np.full(batch, max_prompt), np.full(batch, max_resp)
    else:
        prompts = rng.integers(int(0.6 * max_prompt), max_prompt + 1, batch)
        resps = rng.integers(int(0.3 * max_resp), max_resp + 1, batch)
    width = int((prompts + resps).max())
    ids = np.zeros((batch, width), np.int64)
    attn = np.zeros((batch, width), np.int8)
    loss = np.zeros((batch, width), np.int8)
    for b in range(batch):
        p, n = int(prompts[b]), int(prompts[b] + resps[b])
        ids[b, :n] = rng.integers(0, vocab, n)
        attn[b, :n] = 1
        loss[b, p:n] = 1
        tool = p + int(resps[b]) // 3  # a tool response of up to 24 tokens, not sampled by the policy
        loss[b, tool : min(tool + 24, n - 1)] = 0
    behav = np.where(loss == 1, -rng.random((batch, width)) * 4, 0).astype(np.float32)
    versions = np.where(loss == 1, max(policy_version - 1, 0), -1).astype(np.int32)
    rewards = rng.integers(0, 2, batch).astype(np.float32)
    rewards[::group] = 1.0 - rewards[1::group]  # every group has a reward signal
    return SimpleNamespace(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=loss,
        behavior_logprobs=behav,
        policy_versions=versions,
        prompt_lens=prompts.astype(np.int32),
        seq_lens=attn.sum(1).astype(np.int32),
        rewards=rewards,
        group_index=np.arange(batch, dtype=np.int64) // group,
        turn_scores=[[] for _ in range(batch)],
    )


def _state_gb(engine: Any) -> dict[str, float]:
    """Bytes of what training must hold: fp32 params, their grads and AdamW's two moments."""
    params = sum(p.numel() * p.element_size() for p in engine.policy.parameters())
    return {"params_gb": params / 1024**3, "params_grads_adam_gb": 4 * params / 1024**3}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant in this process: build the engine, run `steps` train steps, measure RSS."""
    from streamrl.core.memory import peak_rss_gb, reset_peak_rss, rss_gb, trim_allocator
    from streamrl.learner.engine import TrainingEngine
    from streamrl.streaming.config import load_config

    cfg = load_config(spec["config"], [*spec["overrides"], f"learner.logits_chunk_tokens={spec['chunk']}"])
    engine = TrainingEngine(cfg.learner)
    vocab = engine.policy.lm.config.vocab_size
    trim = spec["trim"]
    if trim:
        trim_allocator()
    after_init = {"rss_gb": rss_gb(), "peak_rss_gb": peak_rss_gb()}
    steps = []
    for i in range(spec["steps"]):
        batch = run_batch(cfg, vocab, spec["seed"] * 1000 + i, engine.policy_version, longest=spec["longest"])
        reset_peak_rss()
        start = time.perf_counter()
        engine.train_step(batch)
        step_s = time.perf_counter() - start
        step_peak = peak_rss_gb()
        if trim:
            trim_allocator()
        steps.append(
            {
                "step": i + 1,
                "rss_gb": rss_gb(),
                "step_peak_rss_gb": step_peak,
                "step_s": step_s,
                "tokens": int(batch.seq_lens.sum()),
            }
        )
        print(json.dumps({"progress": spec["name"], **steps[-1]}), file=sys.stderr, flush=True)
    return {"spec": spec, "after_init": after_init, "steps": steps, **_state_gb(engine)}


def _spawn(
    spec: dict[str, Any], *, allocator_env: bool, timeout_s: float, env_overrides: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run `worker(spec)` in a fresh interpreter; glibc reads MALLOC_* only at process start."""
    from streamrl.core.memory import learner_runtime_env

    env = {k: v for k, v in os.environ.items() if k not in _MALLOC_VARS}
    runtime = learner_runtime_env() | (env_overrides or {})
    env.update(runtime if allocator_env else {"OMP_NUM_THREADS": runtime["OMP_NUM_THREADS"]})
    cmd = [sys.executable, "-m", "bench.memory_learner", "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout_s, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["env"] = {k: env[k] for k in runtime if k in env}
    return result


def _summary_growth(result: dict[str, Any]) -> dict[str, Any]:
    rss = [s["rss_gb"] for s in result["steps"]]
    at = lambda n: rss[min(n, len(rss)) - 1]  # noqa: E731 — RSS after step n (1-based)
    return {
        "rss_gb_per_step": rss,
        "step_peak_rss_gb_per_step": [s["step_peak_rss_gb"] for s in result["steps"]],
        "step_s_median": float(np.median([s["step_s"] for s in result["steps"]])),
        "rss_after_init_gb": result["after_init"]["rss_gb"],
        "rss_after_step5_gb": at(5),
        "rss_last_gb": rss[-1],
        "growth_last_over_step5": rss[-1] / at(5) - 1.0,
        "peak_rss_gb": max(s["step_peak_rss_gb"] for s in result["steps"]),
        "env": result["env"],
    }


def _chunk_runs(base: dict[str, Any], default_chunk: int, seeds: int, steps: int, timeout_s: float) -> dict:
    """Peak of `steps` train steps on the longest batch: one-tensor logits vs chunked, then chunked
    plus activation checkpointing; allocator settings and trim on in all three."""
    variants = {"unchunked": (0, False), "chunked": (default_chunk, False), "chunked_gc": (default_chunk, True)}
    rows = []
    for seed in range(seeds):
        for name, (chunk, gc) in variants.items():
            spec = {
                **base,
                "overrides": [*base["overrides"], f"learner.gradient_checkpointing={str(gc).lower()}"],
                "name": f"{name}-seed{seed}",
                "chunk": chunk,
                "seed": seed,
                "steps": steps,
                "longest": True,
                "trim": True,
            }
            r = _spawn(spec, allocator_env=True, timeout_s=timeout_s)
            peaks = [s["step_peak_rss_gb"] for s in r["steps"]]
            rows.append(
                {
                    "variant": name,
                    "chunk": chunk,
                    "gradient_checkpointing": gc,
                    "seed": seed,
                    "step_peak_rss_gb": max(peaks),
                    "step_peak_rss_gb_per_step": peaks,
                    "process_peak_rss_gb": max(r["after_init"]["peak_rss_gb"], *peaks),
                    "rss_after_init_gb": r["after_init"]["rss_gb"],
                    "rss_after_gb": r["steps"][-1]["rss_gb"],
                    "step_s": [s["step_s"] for s in r["steps"]],
                    "tokens": r["steps"][0]["tokens"],
                    **{k: r[k] for k in ("params_gb", "params_grads_adam_gb")},
                }
            )
    out: dict[str, Any] = {"runs": rows}
    for name in variants:
        peaks = [r["step_peak_rss_gb"] for r in rows if r["variant"] == name]
        out[name] = {"step_peak_rss_gb_mean": float(np.mean(peaks)), "step_peak_rss_gb_std": float(np.std(peaks))}
    out["peak_saved_by_chunking_gb"] = (
        out["unchunked"]["step_peak_rss_gb_mean"] - out["chunked"]["step_peak_rss_gb_mean"]
    )
    return out


# The plain learner, the default, and the two steps between (see `_peak_variants`).
PEAK_VARIANTS: dict[str, dict[str, Any]] = {
    "before": {
        "what": "mmap threshold 4 MB, no activation checkpointing, logits chunk 512 (the plain learner)",
        "mmap": 4 * 1024 * 1024,
        "gc": False,
        "chunk": 512,
    },
    "mmap128k": {
        "what": "mmap threshold 128 KB, no activation checkpointing, logits chunk 512",
        "mmap": 128 * 1024,
        "gc": False,
        "chunk": 512,
    },
    "mmap128k_gc": {
        "what": "mmap threshold 128 KB, activation checkpointing, logits chunk 512",
        "mmap": 128 * 1024,
        "gc": True,
        "chunk": 512,
    },
    "mmap128k_gc_chunk128": {
        "what": "mmap threshold 128 KB, activation checkpointing, logits chunk 128 (the default now)",
        "mmap": 128 * 1024,
        "gc": True,
        "chunk": 128,
    },
}


def _peak_variants(base: dict[str, Any], seeds: int, steps: int, timeout_s: float) -> dict[str, Any]:
    """Step peak and step time of `PEAK_VARIANTS` on the longest default-shaped batch, each in a fresh
    process, interleaved seed by seed so a noisy machine slows every variant alike."""
    rows = []
    for seed in range(seeds):
        for name, v in PEAK_VARIANTS.items():
            gc = str(v["gc"]).lower()
            spec = {
                **base,
                "overrides": [*base["overrides"], f"learner.gradient_checkpointing={gc}"],
                "name": f"{name}-seed{seed}",
                "chunk": v["chunk"],
                "seed": seed,
                "steps": steps,
                "longest": True,
                "trim": True,
            }
            r = _spawn(
                spec, allocator_env=True, timeout_s=timeout_s, env_overrides={"MALLOC_MMAP_THRESHOLD_": str(v["mmap"])}
            )
            peaks = [s["step_peak_rss_gb"] for s in r["steps"]]
            rows.append(
                {
                    "variant": name,
                    "seed": seed,
                    "step_peak_rss_gb_per_step": peaks,
                    "step_s": [s["step_s"] for s in r["steps"]],
                    "rss_after_gb": r["steps"][-1]["rss_gb"],
                    "tokens": r["steps"][0]["tokens"],
                    "params_grads_adam_gb": r["params_grads_adam_gb"],
                }
            )
    out: dict[str, Any] = {"runs": rows}
    state = rows[0]["params_grads_adam_gb"]
    for name, v in PEAK_VARIANTS.items():
        mine = [r for r in rows if r["variant"] == name]
        peak = max(max(r["step_peak_rss_gb_per_step"]) for r in mine)
        later = [t for r in mine for t in r["step_s"][1:]]  # step 1 also allocates AdamW's moments
        out[name] = {
            "what": v["what"],
            "step_peak_rss_gb_max": peak,
            "peak_over_state": peak / state,
            "step_s_mean": float(np.mean(later)),
            "step_s_std": float(np.std(later)),
        }
    return out


def learner_memory(
    config: str = "configs/default.toml",
    *,
    steps: int = 0,
    seeds: int = 3,
    chunk_steps: int = 2,
    chunks: bool = True,
    overrides: list[str] | None = None,
    growth_variants: tuple[str, ...] = ("before", "after"),
    timeout_s: float = 6 * 3600,
) -> dict[str, Any]:
    """Run the variants (each in its own subprocess) and summarise; see the module docstring.

    `overrides` (run-file `key=value`s) apply to every variant; the growth check's "before" variant
    is then forced back to the pre-issue-9 learner: no chunking, no activation checkpointing."""
    from streamrl.streaming.config import load_config

    cfg = load_config(config, overrides or [])
    default_chunk = cfg.learner.logits_chunk_tokens or 512
    base = {"config": config, "overrides": list(overrides or []), "seed": 0}
    out: dict[str, Any] = {"learner": cfg.learner.model_dump(mode="json"), "default_chunk": default_chunk}
    if chunks:
        out["chunks"] = _chunk_runs(base, default_chunk, seeds, chunk_steps, timeout_s)
        out["state"] = {k: out["chunks"]["runs"][0][k] for k in ("params_gb", "params_grads_adam_gb")}
    if steps > 0:
        variants = {  # name: (chunk, trim + allocator settings, extra overrides)
            "before": (0, False, ["learner.gradient_checkpointing=false"]),  # every memory measure off
            "after": (default_chunk, True, []),  # as the learner runs now
        }
        out["growth"] = {}
        for name, (chunk, fix, extra) in variants.items():
            if name not in growth_variants:
                continue
            spec = {
                **base,
                "overrides": [*base["overrides"], *extra],
                "name": f"growth-{name}",
                "chunk": chunk,
                "steps": steps,
                "longest": False,
                "trim": fix,
            }
            result = _spawn(spec, allocator_env=fix, timeout_s=timeout_s)
            out["growth"][name] = {
                "chunk": chunk,
                "trim": fix,
                "overrides": spec["overrides"],
                **_summary_growth(result),
            }
            out["state"] = {k: result[k] for k in ("params_gb", "params_grads_adam_gb")}
    if "state" in out:
        out["state"]["budget_1p5x_gb"] = 1.5 * out["state"]["params_grads_adam_gb"]
    return out


def _machine() -> dict[str, Any]:
    import torch

    mem_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "total_ram_gb": mem_kb / 1024**2,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.toml")
    parser.add_argument("--steps", type=int, default=0, help="train steps of the growth check (0: no check)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the chunked-vs-unchunked peak")
    parser.add_argument("--chunk-steps", type=int, default=2, help="train steps per chunk-comparison run")
    parser.add_argument("--skip-chunks", action="store_true")
    parser.add_argument(
        "--growth-variants",
        default="before,after",
        help="which growth runs: before (the pre-issue-9 learner), after (as it runs now)",
    )
    parser.add_argument("--override", action="append", default=[], help="a run-file override, key=value")
    parser.add_argument("--out", default="bench/results/memory_learner.json")
    parser.add_argument(
        "--peak-variants",
        action="store_true",
        help="only the allocator/checkpointing/chunk variants of the step peak (PEAK_VARIANTS)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("STREAMRL_CACHE", str(Path(".cache/streamrl").resolve()))
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.peak_variants:
        start = time.perf_counter()
        base = {"config": args.config, "overrides": args.override, "seed": 0}
        result = {
            "command": " ".join(["python -m bench.memory_learner", *(argv if argv is not None else sys.argv[1:])]),
            "machine": _machine(),
            **_peak_variants(base, args.seeds, args.chunk_steps, 6 * 3600),
        }
        result["wall_s"] = time.perf_counter() - start
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "machine")}, indent=1))
        return 0
    start = time.perf_counter()
    result = {
        "command": " ".join(["python -m bench.memory_learner", *(argv if argv is not None else sys.argv[1:])]),
        "machine": _machine(),
        **learner_memory(
            args.config,
            steps=args.steps,
            seeds=args.seeds,
            chunk_steps=args.chunk_steps,
            chunks=not args.skip_chunks,
            overrides=args.override,
            growth_variants=tuple(args.growth_variants.split(",")),
        ),
        "wall_s": time.perf_counter() - start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    brief = {k: v for k, v in (result.get("chunks") or {}).items() if k != "runs"}
    brief |= {
        f"growth_{k}": {m: v[m] for m in ("rss_after_step5_gb", "rss_last_gb", "peak_rss_gb", "step_s_median")}
        for k, v in (result.get("growth") or {}).items()
    }
    print(json.dumps({"state": result.get("state"), **brief, "wall_s": result["wall_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
