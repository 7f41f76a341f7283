"""`streamrl eval`: the held-out evaluation of a run's base model or any of its checkpoints, offline.

    streamrl eval RUN_DIR [--checkpoint base|latest|all|STEP ...] [--out DIR] [key=value ...]
    streamrl eval --config CONFIG [key=value ...]        (the config's starting model)

The same prompts, agent loop, reward and metrics (avg@k, pass@k, pass^k) as the evaluation during
training (streaming/heldout.py), on one local engine per evaluated model. `eval.*` overrides set the
prompts and sampling (`eval.num_prompts=128 eval.k=4 eval.temperature=1.0`). Each evaluation is written
as `OUT/<label>.parquet` with the rows of the training-time files (`policy_version` is -1: the weights
are named by their learner step), and with two or more models the first and the last are compared
prompt by prompt (eval_stats.compare).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamrl.core.run_dir import RunDir
from streamrl.streaming.eval_stats import EvalSummary, compare

logger = logging.getLogger(__name__)

DEFAULT_NUM_PROMPTS = 64  # when the run evaluated nothing during training


@dataclass(kw_only=True, slots=True, frozen=True)
class Target:
    label: str  # "base" or "step_000012"
    model_path: str
    served_step: int


def run_targets(run_dir: Path, which: list[str]) -> list[Target]:
    """The models to evaluate: `base` (the run's starting model), `latest`, `all` or the steps of
    complete checkpoints."""
    run = RunDir.open(run_dir)
    checkpoints = {c.step: c for c in run.complete_checkpoints()}

    def of(step: int) -> Target:
        return Target(label=checkpoints[step].name, model_path=str(checkpoints[step].hf), served_step=step)

    out: list[Target] = []
    for item in which or ["base", "latest"]:
        if item == "base":
            out.append(Target(label="base", model_path=run.info().model_path, served_step=0))
        elif item in ("latest", "all"):
            if not checkpoints:
                raise ValueError(f"{run_dir} has no checkpoint to evaluate (no complete one in {run.checkpoints})")
            out += [of(s) for s in (sorted(checkpoints) if item == "all" else [max(checkpoints)])]
        elif item.isdigit() and int(item) in checkpoints:
            out.append(of(int(item)))
        else:
            raise ValueError(f"--checkpoint {item!r}: use base, latest, all or one of the steps {sorted(checkpoints)}")
    return list({t.label: t for t in out}.values())  # each once, in the order asked


async def evaluate_models(
    cfg, targets: list[Target], records, report: Callable[[Target, EvalSummary, list, float], None]
) -> None:
    """Every target on one local engine: built on the first target's weights, each later target's
    loaded in place (they are checkpoints of one run, so one architecture). A server backend's server
    starts on whatever its command names, so there every target's weights are loaded, the first's too.
    `report` gets each target's summary, trajectories and the seconds its evaluation took (without the
    engine's start) as soon as it is done."""
    from streamrl.engines import make_engine
    from streamrl.streaming.heldout import heldout_metrics, run_heldout

    engine = make_engine(cfg.rollout.engine.model_copy(update={"model": targets[0].model_path}), "engine-0")
    try:
        for i, target in enumerate(targets):
            if i or not cfg.rollout.engine.builds_model:
                await engine.load_weights_from_path(target.model_path, policy_version=i)
            t0 = time.monotonic()
            trajectories = await run_heldout(
                cfg, target.model_path, [engine], records, timeout_s=cfg.trainer.step_timeout_s
            )
            seconds = time.monotonic() - t0
            summary, _ = heldout_metrics(
                trajectories, records, k=cfg.eval.k, threshold=cfg.eval.pass_threshold, seconds=seconds
            )
            report(target, summary, trajectories, seconds)
    finally:
        await engine.shutdown()


def eval_main(
    *, run_dir: str | None, config: str | None, overrides: list[str], checkpoints: list[str], out: str | None
) -> int:
    from streamrl.rollout.data import load_records
    from streamrl.streaming.config import StreamRLConfig, apply_overrides, load_config
    from streamrl.streaming.heldout import heldout_records, per_prompt_rewards, write_rows

    if (run_dir is None) == (config is None):
        raise ValueError("streamrl eval takes a RUN_DIR or --config, not both")
    if run_dir is not None:
        run = RunDir.open(run_dir)
        cfg = StreamRLConfig.model_validate(apply_overrides(run.info().config, overrides))
        targets = run_targets(run.root, checkpoints)
        out_dir = Path(out) if out else run.eval_offline
    else:
        from streamrl.streaming.sft import prepare_model

        cfg = load_config(config, overrides)
        targets = [Target(label="base", model_path=prepare_model(cfg), served_step=0)]
        out_dir = Path(out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    if not cfg.eval.enabled:
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"num_prompts": DEFAULT_NUM_PROMPTS})})
    training = load_records(cfg.data.source, cfg.data.num_prompts, cfg.data.seed, cfg.data.difficulty)
    records = heldout_records(cfg, training)
    out_dir.mkdir(parents=True, exist_ok=True)
    scores: list[dict[str, float]] = []
    print(
        f"{'model':<14} {'step':>5} {'avg@k':>7} {'pass@1':>7} {f'pass@{cfg.eval.k}':>7} {f'pass^{cfg.eval.k}':>7}"
        f"  ({len(records)} prompts x {cfg.eval.k} samples, temperature {cfg.eval.temperature})"
    )

    def report(target: Target, summary: EvalSummary, trajectories: list, seconds: float) -> None:
        write_rows(
            out_dir / f"{target.label}.parquet",
            trajectories,
            served_step=target.served_step,
            policy_version=-1,
            started_elapsed_s=0.0,
            seconds=seconds,
        )
        rewards = per_prompt_rewards(trajectories, records, cfg.eval.k)
        scores.append({p: sum(r) / len(r) for p, r in rewards.items()})
        print(
            f"{target.label:<14} {target.served_step:>5} {summary.avg_reward:>7.3f} {summary.pass_at_1:>7.3f} "
            f"{summary.pass_at_k:>7.3f} {summary.pass_hat_k:>7.3f}",
            flush=True,
        )

    asyncio.run(evaluate_models(cfg, targets, records, report))
    if len(scores) >= 2:
        print(f"{targets[0].label} -> {targets[-1].label}: {compare(scores[0], scores[-1]).line()}")
    print(f"rows written to {out_dir}")
    return 0
