"""Levers for a faster learner step on CPU, measured on the shape `make run` trains.

    python -m bench.levers [--rounds 3] [--out bench/results/levers.json]
    python -m bench.levers --shared-prefix [--rounds 7]   # only the shared-prefix learner, key `shared_prefix`

The batch is one GRPO group as the default trains it: 4 sequences that share one 310-token prompt
(the tool schema and the system prompt) and have 140 response tokens each, on SmolLM2-135M with the
default learner (one sequence per micro-batch, activation checkpointing, a 128-token LM-head chunk,
decoupled correction with log-linear proximal policy). Each round runs every variant once, in
turn (so a slow spell of the shared machine touches all alike), after one warm-up step each:

- `fp32`: the default learner with `shared_prefix` off (each row forwards its own prompt);
- `bf16_autocast`: `learner.dtype = "bfloat16"` (the master weights and AdamW stay fp32);
- `shared_prefix_bound`: the same group with the prompt computed once: 4 sequences of 16 prompt +
  140 response tokens plus the 310-token prompt alone: the time such a step costs at best, before
  the learner could train that way.

`--shared-prefix` measures the learner option that does train this way (`learner.shared_prefix`,
learner/shared_prefix.py) on the same group with one prompt shared by its 4 rows: `dense` (the option
off), `shared` (on, the default's micro_batch_tokens = 640: the packed group of 870 tokens is cut into
two chunks of 2 rows, each repeating the prompt) and `shared_1024` (micro_batch_tokens = 1024: the
whole group in one micro-batch). Each round starts with another variant. It writes the key
`shared_prefix` into the existing results file (a full run keeps that key).

Also measured: how far bf16 autocast moves the log-probs of the same weights (what the correction
would see as off-policy noise): |Δ log p| over response tokens (mean, p99, max) and the share of
tokens whose ratio exp(Δ) leaves PPO's [0.8, 1.2]; and how far each step's peak resident memory rises
above the resident memory before it (the high-water mark is reset before each step).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

PROMPT, RESPONSE, GROUP = 310, 140, 4
BOUND_PROMPT = 16  # what each response keeps of its prompt in the shared-prefix bound


def group_batch(
    vocab: int, prompt_lens: list[int], response_lens: list[int], seed: int = 0, *, one_prompt: bool = False
) -> SimpleNamespace:
    """A buffer-shaped batch (what `TrainingEngine.step` takes) of sequences `prompt + response`;
    with `one_prompt` every row has row 0's prompt tokens, as a GRPO group does."""
    rng = np.random.default_rng(seed)
    n, width = len(prompt_lens), max(p + r for p, r in zip(prompt_lens, response_lens))
    ids = rng.integers(0, vocab, (n, width), dtype=np.int64)
    if one_prompt:
        ids[:, : prompt_lens[0]] = ids[0, : prompt_lens[0]]
    attention = np.zeros((n, width), np.int8)
    loss = np.zeros((n, width), np.int8)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        attention[i, : p + r] = 1
        loss[i, p : p + r] = 1
    return SimpleNamespace(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss,
        behavior_logprobs=np.where(loss == 1, -rng.random((n, width)) * 4, 0).astype(np.float32),
        policy_versions=np.where(loss == 1, 0, -1).astype(np.int32),
        prompt_lens=np.asarray(prompt_lens, np.int32),
        seq_lens=np.asarray([p + r for p, r in zip(prompt_lens, response_lens)], np.int32),
        rewards=np.asarray([1.0, 0.0] * (n // 2) + [0.0] * (n % 2), np.float32),
        group_index=np.zeros(n, np.int64),
        trajectory_ids=[f"t{i}" for i in range(n)],
        group_ids=["g0"] * n,
        turn_scores=[[] for _ in range(n)],
    )


def make_engine(model: str, dtype: str, *, shared_prefix: bool = False, micro_batch_tokens: int = 640):
    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.engine import TrainingEngine

    cfg = LearnerConfig(
        model=model,
        algo="grpo",
        dtype=dtype,
        lr=1e-7,  # the weights barely move: every variant times the same model
        micro_batch_tokens=micro_batch_tokens,
        gradient_checkpointing=True,
        logits_chunk_tokens=128,
        correction={"mode": "decoupled", "prox": "loglinear"},
        shared_prefix=shared_prefix,
    )
    return TrainingEngine(cfg)


def timed_step(engine, batch) -> tuple[float, float]:
    """(seconds, GB the step's peak resident memory rose above the resident memory before it)."""
    from streamrl.core.memory import peak_rss_gb, reset_peak_rss, rss_gb

    reset_peak_rss()
    before = rss_gb()
    start = time.perf_counter()
    engine.train_step(batch)
    return time.perf_counter() - start, peak_rss_gb() - before


def logprob_mismatch(engine, batch) -> dict[str, float]:
    """|log p_bf16 - log p_fp32| of the response tokens under the same weights."""
    import torch

    lm = engine.policy.lm
    ids = torch.as_tensor(batch.input_ids)
    mask = torch.as_tensor(batch.loss_mask[:, 1:]).bool()

    def logprobs(autocast: bool) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = lm(input_ids=ids, attention_mask=torch.as_tensor(batch.attention_mask)).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0][mask]

    diff = (logprobs(True) - logprobs(False)).abs().numpy()
    ratio = np.exp(diff)
    return {
        "tokens": int(diff.size),
        "abs_diff_mean": float(diff.mean()),
        "abs_diff_p99": float(np.quantile(diff, 0.99)),
        "abs_diff_max": float(diff.max()),
        "share_outside_ppo_clip": float(np.mean((ratio > 1.2) | (1 / ratio < 0.8))),
    }


def forwarded_tokens(engine, batch) -> list[int]:
    """Tokens each micro-batch of the training pass forwards (a packed group: its prompt once)."""
    import torch

    tb = engine.to_train_batch(batch)
    return [
        sum(s.num_tokens for s in plan.segments) if plan.segments else int(tb.seq_lens[plan.rows].sum())
        for plan in engine.train_micro_batches(tb, torch.arange(tb.batch_size))
    ]


def shared_prefix_bench(model: str, rounds: int) -> dict:
    """Interleaved rounds of the dense and the shared-prefix learner step on one shared-prompt group;
    the CPU pressure (bench.machine.cpu_pressure) before each round says how shared the machine was."""
    import torch

    from bench.machine import cpu_pressure

    variants = {
        "dense": make_engine(model, "float32"),
        "shared": make_engine(model, "float32", shared_prefix=True),
        "shared_1024": make_engine(model, "float32", shared_prefix=True, micro_batch_tokens=1024),
    }
    batch = group_batch(
        variants["dense"].policy.lm.config.vocab_size, [PROMPT] * GROUP, [RESPONSE] * GROUP, one_prompt=True
    )
    for engine in variants.values():
        timed_step(engine, batch)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    pressure: list[float | None] = []
    names = list(variants)
    for i in range(rounds):  # each round starts with another variant: a slow spell hits all alike
        pressure.append(cpu_pressure())
        for name in names[i % len(names) :] + names[: i % len(names)]:
            runs[name].append(timed_step(variants[name], batch))
    base = statistics.median(s for s, _ in runs["dense"])
    return {
        "batch": {"group_size": GROUP, "prompt_tokens": PROMPT, "response_tokens": RESPONSE, "one_prompt": True},
        "torch_threads": torch.get_num_threads(),
        "cpu_pressure_before_round": pressure,
        "variants": {
            name: {
                "shared_prefix": variants[name].shared_prefix,
                "micro_batch_tokens": variants[name].cfg.micro_batch_tokens,
                "forwarded_tokens_per_micro_batch": forwarded_tokens(variants[name], batch),
                "step_s": [s for s, _ in values],
                "step_s_median": statistics.median(s for s, _ in values),
                "speedup_vs_dense": base / statistics.median(s for s, _ in values),
                "step_peak_rise_gb_max": max(m for _, m in values),
                "step_peak_rise_gb_median": statistics.median(m for _, m in values),
            }
            for name, values in runs.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="smollm2", help="tiny: a quick check of the script")
    parser.add_argument("--out", default="bench/results/levers.json")
    parser.add_argument(
        "--shared-prefix", action="store_true", help="only the shared-prefix learner (key shared_prefix)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.monotonic()
    command = "python -m bench.levers " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.shared_prefix:
        out = Path(args.out)
        results = json.loads(out.read_text()) if out.exists() else {}
        part = {"command": command, "machine": machine(), "date": time.strftime("%Y-%m-%d"), "model": args.model}
        part.update(shared_prefix_bench(args.model, args.rounds))
        part["wall_s"] = time.monotonic() - t0
        results["shared_prefix"] = part
        out.write_text(json.dumps(results, indent=1) + "\n")
        for name, v in part["variants"].items():
            print(
                f"{name}: {v['step_s_median']:.1f} s/step ({v['speedup_vs_dense']:.2f}x dense), "
                f"tokens {v['forwarded_tokens_per_micro_batch']}, step peak +{v['step_peak_rise_gb_max']:.2f} GB"
            )
        print(f"wrote {out}")
        return 0
    fp32, bf16 = make_engine(args.model, "float32"), make_engine(args.model, "bfloat16")
    vocab = fp32.policy.lm.config.vocab_size
    full = group_batch(vocab, [PROMPT] * GROUP, [RESPONSE] * GROUP)
    bound = group_batch(vocab, [BOUND_PROMPT] * GROUP + [PROMPT], [RESPONSE] * GROUP + [1])
    variants = {"fp32": (fp32, full), "bf16_autocast": (bf16, full), "shared_prefix_bound": (fp32, bound)}
    for engine, batch in variants.values():
        timed_step(engine, batch)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (engine, batch) in variants.items():
            runs[name].append(timed_step(engine, batch))
    base = statistics.median(s for s, _ in runs["fp32"])
    result = {
        "command": command,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "batch": {"group_size": GROUP, "prompt_tokens": PROMPT, "response_tokens": RESPONSE},
        "variants": {
            name: {
                "tokens": int(variants[name][1].attention_mask.sum()),
                "step_s": [s for s, _ in values],
                "step_s_median": statistics.median(s for s, _ in values),
                "speedup_vs_fp32": base / statistics.median(s for s, _ in values),
                "step_peak_rise_gb_max": max(m for _, m in values),
            }
            for name, values in runs.items()
        },
        "bf16_logprob_mismatch": logprob_mismatch(fp32, full),
        "wall_s": time.monotonic() - t0,
    }
    out = Path(args.out)
    if out.exists() and "shared_prefix" in (kept := json.loads(out.read_text())):
        result["shared_prefix"] = kept["shared_prefix"]  # measured on its own (--shared-prefix)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, v in result["variants"].items():
        speed, rise = v["speedup_vs_fp32"], v["step_peak_rise_gb_max"]
        print(f"{name}: {v['step_s_median']:.1f} s/step ({speed:.2f}x fp32), step peak +{rise:.2f} GB")
    print("bf16 log-prob mismatch:", result["bf16_logprob_mismatch"])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
