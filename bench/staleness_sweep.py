"""Staleness sweep: final reward for a fixed policy lag k × staleness correction × seed, to show
which correction keeps the reward up as the lag grows.

    python -m bench.staleness_sweep [--lags 0 1 2 4 8] [--corrections none tis decoupled masked m2po]
                                    [--seeds 0 1 2] [--steps 30] [--lr 4e-3] [--workers 2] [--threads 1]
                                    [--out bench/results/staleness_sweep.json]
                                    [--figure bench/results/staleness_sweep.png]

What runs. The REAL learner — `TrainingEngine.train_step` with a `LearnerConfig` whose
`correction.mode` is the cell's preset (GRPO advantages, PPO loss, the correction with π_prox
recomputed by a no-grad pass at the start of each step, AdamW) — trains the locally built `tiny`
model. vLLM is replaced by an in-process torch sampler so the lag is exact and
deterministic and 50 cells fit a 2-core CPU budget: the sampler keeps the last k + 1 weight
snapshots of the learner and, at learner step s (0-based; the engine then holds policy_version s),
samples the batch with version max(0, s − k), temperature 1, no top-p/top-k, from a generator seeded
by (seed, step). Behaviour log-probs are the log-softmax of the sampler's fp32 logits at the sampled
token, and every response token carries the generating version, so the learner sees lag
min(s, k) on every token (exactly k once s ≥ k) and, at lag 0, π_behav equals its own π_prox up to
float error: staleness is isolated from engine/learner numerics. The real system's path to a fixed
lag is `weight_sync.publish_lag`; this bench does not use it.

Task. Prompts are a few random token ids; each prompt gets a GRPO group of sampled responses of
fixed length; reward = fraction of response tokens in a fixed random target subset of the
vocabulary (≈ `TARGET_FRAC` of it, so the untrained model scores ≈ TARGET_FRAC). Common random
numbers: every cell of a seed sees the same prompts and sampling streams.

Reward per step. `reward` is the mean reward of the batch trained at step s — sampled by the policy
k versions behind. `eval_reward` is the reward of the learner's own weights after step s (version
s + 1) on held-out prompts, so it compares lags fairly; `final_reward` is the mean `eval_reward` of
the last 5 steps (`final_train_reward`: the same over `reward`), and `mean_eval_reward` the mean
over all steps (the area under the curve: it still ranks cells whose final reward saturates).

Parallelism: cells are independent and the results do not depend on how they are spread (checked:
identical per-step numbers with 1 and 2 workers). The default is 2 spawned worker processes with 1
torch thread each. On the 2-core bench machine one process with 2 threads was ~5x slower per cell
than with 1 (the tiny model's ops are too small for intra-op threads); 2 workers matched 1 worker
while another job held about a core, and should halve the wall time on an idle machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from bench.machine import machine
from streamrl.learner.config import CorrectionMode, LearnerConfig
from streamrl.learner.engine import TrainingEngine

REPO = Path(__file__).resolve().parents[1]
LAGS = [0, 1, 2, 4, 8]
CORRECTIONS = [m.value for m in CorrectionMode]
TARGET_FRAC = 0.05
FINAL_WINDOW = 5
# learner metrics kept per step. ρ = π_prox/π_behav; mode `none` needs no π_prox, so there the
# learner takes ρ against its training forward (after the first mini-batch: one update past π_prox).
METRIC_KEYS = {
    "learner/entropy": "entropy",
    "learner/grad_norm": "grad_norm",
    "is/ratio_p99": "rho_p99",
    "is/mismatch_kl": "mismatch_kl",
    "is/weight_mean": "is_weight_mean",
    "is/policy_ratio_mean": "policy_ratio_mean",
    "is/clip_frac": "clip_frac",
    "is/mask_frac": "mask_frac",
}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Task and learner knobs shared by every cell: per step, `num_prompts` groups of `group_size`
    responses of `response_len` tokens are trained and `eval_prompts` groups evaluate the learner."""

    steps: int = 30
    prompt_len: int = 4
    response_len: int = 12
    num_prompts: int = 4
    group_size: int = 8
    eval_prompts: int = 4
    lr: float = 4e-3
    num_minibatches: int = 2
    micro_batch_tokens: int = 512
    threads: int = 1


def target_mask(vocab_size: int, frac: float = TARGET_FRAC, seed: int = 1234) -> torch.Tensor:
    """[vocab] bool: the fixed random target subset (ids ≥ 3: pad/bos/eos excluded)."""
    gen = torch.Generator().manual_seed(seed)
    ids = 3 + torch.randperm(vocab_size - 3, generator=gen)[: max(1, round(frac * vocab_size))]
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return mask


def learner_config(correction: str, seed: int, settings: Settings, max_lag: int) -> LearnerConfig:
    """Defaults except: CPU, the cell's correction preset and seed, a fast lr, small micro-batches,
    two mini-batches (so the PPO clip acts even at lag 0) and one lag bucket per swept lag."""
    return LearnerConfig(
        model="tiny",
        device="cpu",
        algo="grpo",
        seed=seed,
        lr=settings.lr,
        num_minibatches=settings.num_minibatches,
        micro_batch_tokens=settings.micro_batch_tokens,
        correction={"mode": correction, "num_lag_buckets": max_lag + 1},
    )


@torch.no_grad()
def sample(
    lm: torch.nn.Module, prompts: torch.Tensor, length: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestral sampling at temperature 1 with a KV cache: (response ids [N, length], their
    log-probs under `lm` [N, length], log-softmax of fp32 logits)."""
    ids, past = prompts, None
    tokens, logps = [], []
    for i in range(length):
        out = lm(ids if i == 0 else ids[:, -1:], past_key_values=past, use_cache=True)
        past = out.past_key_values
        logp_all = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        tok = torch.multinomial(logp_all.exp(), 1, generator=gen)
        tokens.append(tok)
        logps.append(logp_all.gather(-1, tok))
        ids = torch.cat([ids, tok], dim=1)
    return torch.cat(tokens, 1), torch.cat(logps, 1)


def padded_batch(
    prompts: torch.Tensor,
    responses: torch.Tensor,
    logps: torch.Tensor,
    version: int,
    rewards: torch.Tensor,
    group_size: int,
) -> SimpleNamespace:
    """The `PaddedBatch` fields `train_step` reads; all rows have the same length (no padding)."""
    rows, p = prompts.shape
    ids = torch.cat([prompts, responses], 1).numpy()
    width = ids.shape[1]
    on_response = np.zeros((rows, width), np.int8)
    on_response[:, p:] = 1
    behav = np.zeros((rows, width), np.float32)
    behav[:, p:] = logps.numpy()
    return SimpleNamespace(
        input_ids=ids.astype(np.int64),
        attention_mask=np.ones((rows, width), np.int8),
        loss_mask=on_response,
        behavior_logprobs=behav,
        policy_versions=np.where(on_response == 1, version, -1).astype(np.int32),
        prompt_lens=np.full(rows, p, np.int32),
        seq_lens=np.full(rows, width, np.int32),
        rewards=rewards.numpy().astype(np.float32),
        group_index=np.arange(rows, dtype=np.int64) // group_size,
        trajectory_ids=[f"t{b}" for b in range(rows)],
        group_ids=[f"g{b // group_size}" for b in range(rows)],
        turn_scores=[[] for _ in range(rows)],
    )


class Sampler:
    """The stand-in for the rollout engines: a copy of the learner's LM that loads any of the last
    `lag + 1` weight snapshots (CPU state_dict copies, keyed by policy_version)."""

    def __init__(self, engine: TrainingEngine, lag: int, settings: Settings, seed: int) -> None:
        self.lm = copy.deepcopy(engine.policy.lm).eval()
        self.lag, self.settings, self.seed = lag, settings, seed
        self.target = target_mask(self.lm.config.vocab_size)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.record(engine)

    def record(self, engine: TrainingEngine) -> None:
        """Snapshot the learner's current weights; forget versions no future step can need."""
        version = engine.policy_version
        self.snapshots[version] = {k: v.detach().clone() for k, v in engine.policy.lm.state_dict().items()}
        for old in [v for v in self.snapshots if v < version - self.lag]:
            del self.snapshots[old]

    def rollout(
        self, version: int, stream: int, num_prompts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt rows, responses, behaviour log-probs, rewards) of `num_prompts` groups sampled by
        snapshot `version`; `stream` seeds prompts and sampling (same stream → same random numbers)."""
        s = self.settings
        gen = torch.Generator().manual_seed(stream)
        self.lm.load_state_dict(self.snapshots[version])
        prompts = torch.randint(3, self.lm.config.vocab_size, (num_prompts, s.prompt_len), generator=gen)
        rows = prompts.repeat_interleave(s.group_size, 0)
        responses, logps = sample(self.lm, rows, s.response_len, gen)
        return rows, responses, logps, self.target[responses].float().mean(1)

    def train_batch(self, step: int) -> tuple[SimpleNamespace, int]:
        """The batch of learner step `step`, sampled by version max(0, step − lag), and that version."""
        version = max(0, step - self.lag)
        stream = 1_000_003 * self.seed + 2 * step
        rows, responses, logps, rewards = self.rollout(version, stream, self.settings.num_prompts)
        return padded_batch(rows, responses, logps, version, rewards, self.settings.group_size), version

    def eval_reward(self, version: int, step: int) -> float:
        """Mean reward of snapshot `version` (the learner's current weights) on held-out prompts."""
        *_, rewards = self.rollout(version, 1_000_003 * self.seed + 2 * step + 1, self.settings.eval_prompts)
        return float(rewards.mean())


def learner_lag(metrics: dict[str, float], num_buckets: int) -> float:
    """Mean token lag the learner saw, from its per-lag token fractions (one bucket per lag)."""
    return sum(k * metrics.get(f"is/token_frac/lag_{k}", 0.0) for k in range(num_buckets))


def _init_worker(threads: int) -> None:
    """A sweep worker: its torch thread count, and transformers' lazy imports done before the first
    cell starts its clock."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    torch.set_num_threads(threads)


def run_cell(lag: int, correction: str, seed: int, settings: Settings, max_lag: int) -> dict[str, Any]:
    """Train one (lag, correction, seed) cell for `settings.steps` learner steps."""
    start = time.perf_counter()
    engine = TrainingEngine(learner_config(correction, seed, settings, max_lag))
    sampler = Sampler(engine, lag, settings, seed)
    steps: list[dict[str, float]] = []
    for step in range(settings.steps):
        assert engine.policy_version == step  # the engine starts at 0 and counts train steps
        batch, version = sampler.train_batch(step)
        metrics = engine.train_step(batch)
        sampler.record(engine)
        row = {
            "step": step,
            "behaviour_version": version,
            "reward": float(batch.rewards.mean()),
            "eval_reward": sampler.eval_reward(engine.policy_version, step),
            "learner_lag": learner_lag(metrics, max_lag + 1),
            # share of the step's tokens the learner put at lag step − version (1.0: exact lag)
            "learner_lag_frac": metrics.get(f"is/token_frac/lag_{step - version}", 0.0),
        }
        row |= {name: metrics[key] for key, name in METRIC_KEYS.items() if key in metrics}
        steps.append(row)
    columns = {key: [r.get(key, float("nan")) for r in steps] for key in steps[0]}
    return {
        "lag": lag,
        "correction": correction,
        "seed": seed,
        "final_reward": statistics.fmean(columns["eval_reward"][-FINAL_WINDOW:]),
        "final_train_reward": statistics.fmean(columns["reward"][-FINAL_WINDOW:]),
        "mean_eval_reward": statistics.fmean(columns["eval_reward"]),
        "wall_s": round(time.perf_counter() - start, 2),
        "per_step": {key: [round(v, 5) for v in values] for key, values in columns.items()},
    }


def _run_cell_args(args: tuple[int, str, int, Settings, int]) -> dict[str, Any]:
    return run_cell(*args)


def run_sweep(
    lags: list[int], corrections: list[str], seeds: list[int], settings: Settings, workers: int
) -> list[dict[str, Any]]:
    """Every cell, in this process (workers = 1; torch threads left as they are) or over `workers`
    spawned processes with `settings.threads` torch threads each."""
    jobs = [(lag, c, seed, settings, max(lags)) for seed in seeds for c in corrections for lag in lags]
    if workers == 1:
        return _collect(map(_run_cell_args, jobs), len(jobs))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(settings.threads,)
    ) as pool:
        return _collect(pool.map(_run_cell_args, jobs), len(jobs))


def _collect(results: Iterator[dict[str, Any]], total: int) -> list[dict[str, Any]]:
    """The cells in job order, with a progress line as each one arrives."""
    cells = []
    for cell in results:
        cells.append(cell)
        r = cell["per_step"]["eval_reward"]
        print(
            f"[{len(cells)}/{total}] lag={cell['lag']} {cell['correction']:<9} seed={cell['seed']} eval reward "
            f"{r[0]:.3f} -> final {cell['final_reward']:.3f} in {cell['wall_s']:.1f}s",
            flush=True,
        )
    return cells


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean ± sd (over seeds) of final reward per (lag, correction)."""
    keys = sorted({(c["lag"], c["correction"]) for c in cells}, key=lambda k: (k[0], CORRECTIONS.index(k[1])))
    rows = []
    for lag, corr in keys:
        same = [c for c in cells if (c["lag"], c["correction"]) == (lag, corr)]
        finals = [c["final_reward"] for c in same]
        rows.append(
            {
                "lag": lag,
                "correction": corr,
                "num_seeds": len(same),
                "final_reward_mean": statistics.fmean(finals),
                "final_reward_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                "final_train_reward_mean": statistics.fmean(c["final_train_reward"] for c in same),
                "mean_eval_reward_mean": statistics.fmean(c["mean_eval_reward"] for c in same),
            }
        )
    return rows


def markdown_table(summary: list[dict[str, Any]], metric: str = "final_reward") -> str:
    """Lags as rows, corrections as columns: `mean ± sd` of `metric` (or the mean alone when the
    summary has no sd for it)."""
    corrections = [c for c in CORRECTIONS if any(r["correction"] == c for r in summary)]
    lags = sorted({r["lag"] for r in summary})

    def fmt(r: dict[str, Any]) -> str:
        sd = r.get(f"{metric}_sd")
        return f"{r[f'{metric}_mean']:.3f}" + ("" if sd is None else f" ± {sd:.3f}")

    cell = {(r["lag"], r["correction"]): fmt(r) for r in summary}
    lines = ["| lag | " + " | ".join(corrections) + " |", "|---" * (len(corrections) + 1) + "|"]
    lines += [f"| {lag} | " + " | ".join(cell.get((lag, c), "–") for c in corrections) + " |" for lag in lags]
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], summary: list[dict[str, Any]], path: Path) -> None:
    """Top: heatmap of mean final reward (lag × correction). Bottom: eval reward vs step per lag,
    one panel per correction (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corrections = [c for c in CORRECTIONS if any(r["correction"] == c for r in summary)]
    lags = sorted({r["lag"] for r in summary})
    fig = plt.figure(figsize=(3.2 * len(corrections), 8.5))
    grid = fig.add_gridspec(2, len(corrections), height_ratios=[1.1, 1])
    ax = fig.add_subplot(grid[0, :])
    means = {(r["lag"], r["correction"]): r for r in summary}
    image = np.array([[means[(lag, c)]["final_reward_mean"] for c in corrections] for lag in lags])
    im = ax.imshow(image, cmap="viridis", aspect="auto", vmin=0.0, vmax=1.0)
    for i, lag in enumerate(lags):
        for j, c in enumerate(corrections):
            r = means[(lag, c)]
            ax.text(
                j,
                i,
                f"{r['final_reward_mean']:.3f}\n±{r['final_reward_sd']:.3f}",
                ha="center",
                va="center",
                color="white" if r["final_reward_mean"] < 0.5 else "black",
                fontsize=8,
            )
    ax.set(
        xticks=range(len(corrections)),
        xticklabels=corrections,
        yticks=range(len(lags)),
        yticklabels=lags,
        ylabel="policy lag k",
        title=f"final reward (eval, mean of last {FINAL_WINDOW} steps; mean ± sd over seeds)",
    )
    fig.colorbar(im, ax=ax)
    for j, c in enumerate(corrections):
        sub = fig.add_subplot(grid[1, j])
        for lag in lags:
            runs = [x for x in cells if x["lag"] == lag and x["correction"] == c]
            curves = np.array([x["per_step"]["eval_reward"] for x in runs])
            sub.plot(np.arange(1, curves.shape[1] + 1), curves.mean(0), label=f"k={lag}")
        sub.set(
            title=c,
            xlabel="policy version (steps trained)",
            ylim=(0.0, 1.02),
            ylabel="eval reward (mean over seeds)" if j == 0 else None,
        )
        if j == 0:
            sub.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Indented JSON, except one line per cell (its per-step columns would take a line per number)."""
    head = json.dumps({k: v for k, v in result.items() if k != "cells"}, indent=2)
    cells = ",\n".join("    " + json.dumps(cell) for cell in result["cells"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head[:-2]},\n  "cells": [\n{cells}\n  ]\n}}\n')


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lags", type=int, nargs="+", default=LAGS)
    parser.add_argument("--corrections", nargs="+", choices=CORRECTIONS, default=CORRECTIONS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--workers", type=int, default=2, help="processes (each with --threads torch threads)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench/results/staleness_sweep.json")
    parser.add_argument("--figure", default="bench/results/staleness_sweep.png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings(steps=args.steps, lr=args.lr, threads=args.threads)
    if args.workers == 1:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    cells = run_sweep(args.lags, args.corrections, args.seeds, settings, args.workers)
    summary = summarize(cells)
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    result = {
        "command": " ".join(["python -m bench.staleness_sweep", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(torch=torch.__version__),
        "commit": git.stdout.strip(),
        "settings": asdict(settings)
        | {
            "lags": args.lags,
            "corrections": args.corrections,
            "seeds": args.seeds,
            "workers": args.workers,
            "target_frac": TARGET_FRAC,
            "final_window": FINAL_WINDOW,
        },
        "wall_s": time.perf_counter() - start,
        "summary": summary,
        "cells": cells,
    }
    write_json(result, Path(args.out))
    plot(cells, summary, Path(args.figure))
    print(f"final reward (eval, mean of the last {FINAL_WINDOW} steps), mean ± sd over seeds {args.seeds}:")
    print(markdown_table(summary))
    print(f"\nmean eval reward over all {args.steps} steps (area under the curve), mean over seeds:")
    print(markdown_table(summary, "mean_eval_reward"))
    print(f"wrote {args.out} and {args.figure} in {result['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
