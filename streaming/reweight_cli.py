"""`streamrl staleness reweight RUN_DIR --checkpoint STEP [--correction SPEC ...] [--steps A:B] [--out DIR]`.

Reads the batches the run trained on, in consumption order, from its durable buffer (the same
reader as `train --replay`), recomputes log π_prox for them under the checkpoint's weights with the
learner's own forward (micro-batched, no grad, CPU), and evaluates every requested correction on
the same data (`learner/reweight.py` says precisely what each number means). Writes
`reweight.json` and `reweight.txt` (the printed table) to RUN_DIR/staleness/ or --out.

SPEC is a preset (`none`, `tis`, `decoupled`, `masked`, `m2po`), `run` (the run's own correction),
or either with choices replaced: `decoupled:rejection=bounds,rejection_level=geometric`. Caps,
bounds and thresholds are the run's. Default: every preset. --steps A:B selects learner steps
A..B inclusive (either end may be left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.core.run_dir import Checkpoint, RunDir
from streamrl.core.versions import PolicyVersion
from streamrl.learner.config import CorrectionMode
from streamrl.streaming.driver_state import DriverState

if TYPE_CHECKING:
    import torch

    from streamrl.learner.types import TrainBatch
    from streamrl.streaming.config import StreamRLConfig

logger = logging.getLogger(__name__)

DEFAULT_CORRECTIONS = tuple(m.value for m in CorrectionMode)


def find_checkpoint(run_dir: Path, step: int) -> Checkpoint:
    """The run's complete checkpoint of learner step `step`, or ValueError listing those there are."""
    found = {c.step: c for c in RunDir(run_dir).complete_checkpoints()}
    if step not in found:
        listed = ", ".join(str(s) for s in found) or "none"
        raise ValueError(f"{run_dir} has no checkpoint of step {step}; available: {listed}")
    return found[step]


def checkpoint_label(run_dir: Path, ckpt: Checkpoint) -> int:
    """Version label of the checkpoint's weights: its learner step + the run's version offset at the
    time (0 unless a resume relabelled versions; known from the driver state for the latest one)."""
    step = int(json.loads(ckpt.state_file.read_text())["policy_version"])
    state_path = RunDir(run_dir).driver_state
    if state_path.exists():
        state = DriverState.load(state_path)
        if state.checkpoint and Path(state.checkpoint).name == ckpt.name:
            return PolicyVersion(step, state.checkpoint_version_offset).label
    return step


def parse_steps(spec: str | None) -> tuple[int | None, int | None]:
    if not spec:
        return None, None
    lo, sep, hi = spec.partition(":")
    try:
        if not sep:
            return int(lo), int(lo)
        return (int(lo) if lo else None), (int(hi) if hi else None)
    except ValueError:
        raise ValueError(f"--steps {spec!r}: expected A:B, A:, :B or A (learner steps)") from None


def _token_lags(tb: TrainBatch, traj_lags: Any) -> torch.Tensor:
    """Logged token lag: served version (trajectory lag + its oldest token version) − token version."""
    import torch

    valid = tb.loss_mask != 0
    oldest = torch.where(valid, tb.policy_versions, torch.iinfo(torch.int64).max).min(dim=1).values
    served = torch.as_tensor(traj_lags, dtype=torch.int64) + oldest
    lag = torch.where(valid, served[:, None] - tb.policy_versions, torch.zeros_like(tb.policy_versions))
    assert bool((lag >= 0).all()), "logged lags are never negative"
    return lag


def _advantages(cfg: StreamRLConfig, tb: TrainBatch) -> torch.Tensor:
    from streamrl.learner.advantages import broadcast_sequence_advantages, grpo_advantages
    from streamrl.learner.step_inputs import sequence_returns

    returns = sequence_returns(tb, cfg.learner.use_turn_scores)
    seq_adv = grpo_advantages(returns, tb.group_index, scale_std=cfg.learner.effective_scale_std)
    return broadcast_sequence_advantages(seq_adv, tb.loss_mask)


def _engine(cfg: StreamRLConfig, ckpt: Checkpoint):
    """A CPU learner holding the checkpoint's weights (its HF folder), no value head, no reference."""
    from streamrl.learner.config import Algo
    from streamrl.learner.engine import TrainingEngine

    lcfg = cfg.learner.model_copy(
        update={
            "model": str(ckpt.hf),
            "device": "cpu",
            "algo": Algo.GRPO,
            "use_reference": False,
            "gradient_checkpointing": False,
        }
    )
    return TrainingEngine(lcfg)


def reweight(
    run_dir: str | Path,
    step: int,
    corrections: list[str] | None = None,
    *,
    steps: str | None = None,
    out: str | Path | None = None,
) -> tuple[dict[str, Any], Path]:
    """Evaluate `corrections` on the logged batches under checkpoint `step`; returns (result, json path)."""
    import torch

    from streamrl.buffer.padding import pad_table
    from streamrl.learner.reweight import (
        ClipSettings,
        TokenEffect,
        correction_effect,
        parse_correction,
        rho_by,
        summarize,
    )
    from streamrl.learner.types import TrainBatch
    from streamrl.streaming.config import StreamRLConfig

    run_dir = Path(run_dir)
    _check_run_dir(run_dir)
    ckpt = find_checkpoint(run_dir, step)
    cfg = StreamRLConfig.model_validate(RunDir(run_dir).info().config)
    specs = list(corrections or DEFAULT_CORRECTIONS)
    configs = {spec: parse_correction(spec, cfg.learner.correction) for spec in specs}
    chosen = _chosen_batches(run_dir, steps)
    label = checkpoint_label(run_dir, ckpt)
    engine = _engine(cfg, ckpt)
    clip = ClipSettings(
        clip_low=cfg.learner.clip_low, clip_high=cfg.learner.clip_high, dual_clip_c=cfg.learner.dual_clip_c
    )
    effects: dict[str, list[TokenEffect]] = {spec: [] for spec in specs}
    gaps = []
    for learner_step, rows, traj_lags in chosen:
        tb = TrainBatch.from_padded(pad_table(rows))
        prox = engine.compute_logprobs(tb)  # no grad, the training micro-batching
        lag, adv = _token_lags(tb, traj_lags), _advantages(cfg, tb)
        valid = tb.loss_mask != 0
        gaps.append(label - tb.policy_versions[valid])
        for spec, ccfg in configs.items():
            effects[spec].append(correction_effect(prox, tb.behavior_logprobs, lag, tb.loss_mask, adv, ccfg, clip))
        logger.info("reweight: step %d, %d sequences, %d action tokens", learner_step, tb.batch_size, int(valid.sum()))
    num_buckets = cfg.learner.correction.num_lag_buckets
    pooled = {spec: TokenEffect.concat(parts) for spec, parts in effects.items()}
    any_effect = next(iter(pooled.values()))
    buckets = any_effect.lag.clamp(max=num_buckets)
    result = {
        "run_dir": str(run_dir),
        "checkpoint": str(ckpt.path),
        "checkpoint_step": step,
        "checkpoint_policy_version": label,
        "exact_step": step + 1,  # the step whose real π_prox is this checkpoint's weights
        "steps": [b[0] for b in chosen],
        "num_lag_buckets": num_buckets,
        "advantages": "grpo"
        if cfg.learner.algo.value == "grpo"
        else f"grpo (run algo {cfg.learner.algo.value}: approximation)",
        "advantage_nonzero_frac": float((any_effect.advantage != 0).double().mean()),  # 0: no gradient at all
        "rho_by_lag": {
            _bucket(k, num_buckets): dataclasses.asdict(v) for k, v in rho_by(any_effect.rho, buckets).items()
        },
        "rho_by_version_gap": {
            str(k): dataclasses.asdict(v) for k, v in rho_by(any_effect.rho, torch.cat(gaps)).items()
        },
        "corrections": [
            {**dataclasses.asdict(summarize(spec, e, num_buckets)), "config": configs[spec].model_dump(mode="json")}
            for spec, e in pooled.items()
        ],
    }
    out_dir = Path(out) if out else RunDir(run_dir).staleness
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "reweight.json"
    path.write_text(json.dumps(result, indent=2))
    (out_dir / "reweight.txt").write_text(table(result) + "\n")
    return result, path


def _check_run_dir(run_dir: Path) -> None:
    """A run directory with a buffer to replay, or ValueError saying what is missing."""
    run = RunDir.open(run_dir)
    if not run.buffer.is_dir():
        raise ValueError(f"{run_dir} has no buffer directory ({run.buffer}); nothing was logged")


def _chosen_batches(run_dir: Path, steps: str | None) -> list[tuple[int, Any, Any]]:
    """The consumed batches the buffer logged, (learner_step, rows, lags) each, within `--steps`."""
    from streamrl.streaming.replay import logged_batches

    lo, hi = parse_steps(steps)
    batches = logged_batches(RunDir(run_dir).buffer)
    if not batches:
        raise ValueError(f"{run_dir}: the buffer records no consumed batches")
    chosen = [b for b in batches if (lo is None or b[0] >= lo) and (hi is None or b[0] <= hi)]
    if not chosen:
        raise ValueError(
            f"--steps {steps}: no logged step in range; logged steps are {batches[0][0]}..{batches[-1][0]}"
        )
    return chosen


def _bucket(k: int, num_buckets: int) -> str:
    return f"lag_{k}" if k < num_buckets else f"lag_{num_buckets}plus"


def table(result: dict[str, Any]) -> str:
    """The printed report: ρ by lag and by version gap, then one row per correction."""
    from streamrl.learner.is_metrics import lag_bucket_names

    lines = [
        f"checkpoint step {result['checkpoint_step']} (policy_version {result['checkpoint_policy_version']}) "
        f"on steps {result['steps'][0]}..{result['steps'][-1]}; exact π_prox for step {result['exact_step']}"
    ]
    for title, stats in (("lag", result["rho_by_lag"]), ("version gap", result["rho_by_version_gap"])):
        parts = [f"{k}: n={v['num_tokens']} mean={v['mean']:.3f} kl={v['mismatch_kl']:.2e}" for k, v in stats.items()]
        lines.append(f"ρ = π_prox/π_behav by {title}: " + "; ".join(parts))
    lines.append(
        f"action tokens with a non-zero advantage: {result['advantage_nonzero_frac']:.3f}"
        + (
            " (uniform rewards in every group: no policy gradient, loss shares 0)"
            if result["advantage_nonzero_frac"] == 0
            else ""
        )
    )
    shares = [
        n
        for n in lag_bucket_names(result["num_lag_buckets"])
        if any(n in c["loss_share"] for c in result["corrections"])
    ]
    header = [
        "correction",
        "w_mean",
        "w_max",
        "trunc",
        "mask",
        "seq_mask",
        "seq_rej",
        "clip",
        "ESS",
        "g_mean",
        *[f"share_{n.removeprefix('lag_')}" for n in shares],
    ]
    rows = [
        [
            c["correction"],
            f"{c['weight_mean']:.3f}",
            f"{c['weight_max']:.3f}",
            *(
                f"{c[k]:.3f}"
                for k in (
                    "truncated_frac",
                    "masked_frac",
                    "seq_masked_frac",
                    "seq_rejected_frac",
                    "clip_frac",
                    "ess",
                    "grad_weight_mean",
                )
            ),
            *(f"{c['loss_share'].get(n, 0.0):.3f}" for n in shares),
        ]
        for c in result["corrections"]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [header, *rows]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl staleness reweight", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir")
    parser.add_argument(
        "--checkpoint",
        type=int,
        required=True,
        metavar="STEP",
        help="learner step of a checkpoint in RUN_DIR/checkpoints/",
    )
    parser.add_argument(
        "--correction", action="append", metavar="SPEC", help=f"repeatable; default: {' '.join(DEFAULT_CORRECTIONS)}"
    )
    parser.add_argument("--steps", metavar="A:B", help="learner steps to include, inclusive (default: all)")
    parser.add_argument("--out", metavar="DIR", help="output folder (default: RUN_DIR/staleness)")
    return parser


def reweight_main(argv: list[str]) -> int:
    """`streamrl staleness reweight ...` (argv after `reweight`)."""
    args = build_parser().parse_args(argv)
    result, path = reweight(args.run_dir, args.checkpoint, args.correction, steps=args.steps, out=args.out)
    print(table(result))
    print(f"wrote {path}")
    return 0
