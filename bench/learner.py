"""Learner benchmark: train-step tokens/s on SmolLM2-135M at 8×256 and the proximal-recompute overhead.

    python -m bench.learner [--model smollm2] [--steps 1] [--out bench/results/learner.json]

Same synthetic GRPO batch (8 sequences: 64 prompt + 192 response tokens, behavior logprobs one
version stale) through `TrainingEngine.train_step` with decoupled correction, twice:
- `prox = recompute`: the extra no-grad forward pass for π_prox at the start of the step;
- `prox = loglinear`: π_prox interpolated from versions (no extra pass).
The overhead is the step-time ratio minus one. Falls back to the tiny model (and says so) when
SmolLM2 cannot be built.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

logger = logging.getLogger(__name__)

BATCH, PROMPT, RESPONSE = 8, 64, 192


def synthetic_batch(vocab: int, seed: int = 0) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    width = PROMPT + RESPONSE
    loss = np.zeros((BATCH, width), np.int8)
    loss[:, PROMPT:] = 1
    return SimpleNamespace(
        input_ids=rng.integers(0, vocab, (BATCH, width), dtype=np.int64),
        attention_mask=np.ones((BATCH, width), np.int8),
        loss_mask=loss,
        behavior_logprobs=np.where(loss == 1, -rng.random((BATCH, width)) * 8, 0).astype(np.float32),
        policy_versions=np.where(loss == 1, 0, -1).astype(np.int32),
        prompt_lens=np.full(BATCH, PROMPT, np.int32),
        seq_lens=np.full(BATCH, width, np.int32),
        rewards=rng.random(BATCH).astype(np.float32),
        group_index=np.arange(BATCH, dtype=np.int64) // 4,
        trajectory_ids=[f"t{i}" for i in range(BATCH)],
        group_ids=[f"g{i // 4}" for i in range(BATCH)],
        turn_scores=[[] for _ in range(BATCH)],
    )


def time_steps(model: str, steps: int) -> dict[str, dict[str, float]]:
    """One engine, one warm-up step, then `steps` rounds alternating prox recompute / loglinear
    (interleaved so background load on a shared machine hits both alike)."""
    from streamrl.learner.config import LearnerConfig, ProxMode
    from streamrl.learner.engine import TrainingEngine

    cfg = LearnerConfig(
        model=model,
        algo="grpo",
        device="auto",
        lr=1e-6,
        micro_batch_tokens=BATCH * (PROMPT + RESPONSE),
        correction={"mode": "decoupled", "prox": "recompute"},
    )
    engine = TrainingEngine(cfg)
    batch = synthetic_batch(engine.policy.lm.config.vocab_size)
    times: dict[str, list[float]] = {ProxMode.RECOMPUTE: [], ProxMode.LOGLINEAR: []}
    recompute: list[float] = []
    rounds = [[ProxMode.LOGLINEAR]] + [[ProxMode.RECOMPUTE, ProxMode.LOGLINEAR]] * steps
    for i, modes in enumerate(rounds):
        for prox in modes:
            engine.cfg.correction.prox = prox
            batch.policy_versions[batch.loss_mask == 1] = max(engine.policy_version - 1, 0)
            start = time.perf_counter()
            metrics = engine.train_step(batch)
            elapsed = time.perf_counter() - start
            if i == 0:
                continue  # warm-up
            times[prox].append(elapsed)
            if prox == ProxMode.RECOMPUTE:
                recompute.append(metrics["learner/recompute_time_s"])
    out = {}
    for prox, values in times.items():
        step_s = float(np.median(values))
        out[f"prox_{prox.value}"] = {
            "step_s_median": step_s,
            "step_s_all": values,
            "tokens_per_s": BATCH * (PROMPT + RESPONSE) / step_s,
        }
    out["prox_recompute"]["recompute_pass_s_median"] = float(np.median(recompute))
    out["device"] = str(engine.device)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", default="bench/results/learner.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    import torch

    from streamrl.models import resolve_model

    model, note = args.model, None
    try:
        resolve_model(model)
    except Exception as exc:  # fault boundary: a missing GGUF/converter must not lose the bench
        note = f"model {model!r} unavailable ({exc}); fell back to the tiny model"
        model = "tiny"
    start = time.perf_counter()
    timed = time_steps(model, args.steps)
    recompute, loglinear = timed["prox_recompute"], timed["prox_loglinear"]
    result = {
        "command": " ".join(["python -m bench.learner", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": __import__("os").cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "model": model,
        "note": note,
        "batch": {"sequences": BATCH, "tokens_per_sequence": PROMPT + RESPONSE, "action_tokens": BATCH * RESPONSE},
        "config": "grpo, decoupled correction, 1 epoch, 1 mini-batch, 1 micro-batch, fp32",
        "device": timed["device"],
        "prox_recompute": recompute,
        "prox_loglinear": loglinear,
        "tokens_per_s": recompute["tokens_per_s"],
        # extra time of the π_prox forward pass relative to a step without it
        "recompute_overhead": recompute["recompute_pass_s_median"] / loglinear["step_s_median"],
        "recompute_overhead_from_step_times": recompute["step_s_median"] / loglinear["step_s_median"] - 1.0,
        "wall_s": time.perf_counter() - start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("model", "tokens_per_s", "recompute_overhead", "wall_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
