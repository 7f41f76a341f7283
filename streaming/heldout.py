"""Held-out evaluation during training, pinned to one policy version per evaluation.

A training step's mean reward is a handful of samples of the training stream, drawn by several
policy versions: a noisy, mixed signal. The held-out evaluation is `eval.num_prompts` prompts kept
apart from the training stream (`eval.source`, or for a generated source a draw with another seed,
minus any prompt the training stream also holds), each sampled `eval.k` times at `eval.temperature`
through the same engines and agent loop (tools, parser, interactions, reward) as training.

When: before the first learner step (served step 0), at the first publish that reaches each multiple
of `eval.every_steps`, and after the last step. In async mode the training rollouts keep flowing:
evaluation requests share the engines. **Version pinning**: an evaluation starts right after a
publish, labelled with the version the engines then serve, and the next weight sync waits for it
(`Evaluator.hold`, at most `eval.max_hold_s`), so every one of its tokens comes from that version.
The learner keeps training meanwhile; only the publish waits. An evaluation that outlives the hold
is abandoned (counted, nothing written) rather than mixed. Every trajectory's per-token versions are
checked against the label before anything is written.

Where: one parquet file per evaluation in `RUN_DIR/eval/` (policy version, served step, prompt id,
sample index, reward, status, response tokens, wall time), never in the training buffer, so any
evaluation can be re-scored offline; `eval/*` metrics (avg@k, pass@k, pass^k: `eval_stats`) on a
line of their own. A resumed run reads which served steps `RUN_DIR/eval/` already holds and goes on
with the schedule: no evaluation is repeated or skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.core.run_dir import RunDir
from streamrl.rollout.types import PromptRecord, Trajectory, TrajectoryStatus
from streamrl.streaming.eval_stats import EvalSummary, summarize

if TYPE_CHECKING:
    from streamrl.streaming.config import StreamRLConfig
    from streamrl.streaming.pipeline import Pipeline

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003  # a generated source's held-out draw: data.seed + this
EVAL_GROUP_PREFIX = "eval/"  # group ids of held-out trajectories (never in the training stream)


def heldout_records(cfg: StreamRLConfig, training: list[PromptRecord]) -> list[PromptRecord]:
    """The held-out prompts: `eval.num_prompts` of `eval.source` (or a draw of the generated training
    source with another seed) that the training stream does not hold, group ids prefixed `eval/`."""
    from streamrl.rollout.data import load_records
    from streamrl.rollout.data.loaders import messages_hash

    data, n = cfg.data, cfg.eval.num_prompts
    if cfg.eval.source is not None:
        candidates = load_records(cfg.eval.source, n, data.seed, data.difficulty)
    else:  # validated: only generated sources have no eval.source
        candidates = load_records(data.source, 2 * n, data.seed + EVAL_SEED_OFFSET, data.difficulty)
    seen = {messages_hash(r.messages) for r in training}
    records = [r for r in candidates if messages_hash(r.messages) not in seen][:n]
    if len(records) < n:
        raise ValueError(
            f"eval.num_prompts={n} but only {len(records)} held-out prompts are not also training prompts "
            f"({cfg.eval.source or data.source}); lower it or give eval.source more prompts"
        )
    return [dataclasses.replace(r, group_id=EVAL_GROUP_PREFIX + r.group_id) for r in records]


def eval_config(cfg: StreamRLConfig) -> StreamRLConfig:
    """The run's config with the agent sampling at `eval.temperature`."""
    agent = cfg.rollout.agent
    sampling = agent.sampling.model_copy(update={"temperature": cfg.eval.temperature})
    rollout = cfg.rollout.model_copy(update={"agent": agent.model_copy(update={"sampling": sampling})})
    return cfg.model_copy(update={"rollout": rollout})


async def run_heldout(
    cfg: StreamRLConfig, model_path: str, engines: list[Any], records: list[PromptRecord], *, timeout_s: float
) -> list[Trajectory]:
    """`eval.k` trajectories per record at the eval temperature on `engines` (`InferenceEngine`s), in
    this process; the finished and failed trajectories, in no particular order."""
    from streamrl.streaming.eval import rollouts_on

    return await rollouts_on(engines, eval_config(cfg), model_path, records, group_size=cfg.eval.k, timeout_s=timeout_s)


def prompt_id(traj: Trajectory) -> str:
    """The held-out prompt of a trajectory (its group id without the epoch suffix)."""
    return traj.group_id.rpartition("@")[0] or traj.group_id


def per_prompt_rewards(trajectories: list[Trajectory], records: list[PromptRecord], k: int) -> dict[str, list[float]]:
    """Every prompt's `k` rewards; a failed or missing sample scores 0 (it counts against the policy)."""
    rewards: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        rewards[prompt_id(t)].append(t.reward if t.status is TrajectoryStatus.FINISHED else 0.0)
    return {r.group_id: (rewards.get(r.group_id, []) + [0.0] * k)[:k] for r in records}


def heldout_metrics(
    trajectories: list[Trajectory], records: list[PromptRecord], *, k: int, threshold: float, seconds: float
) -> tuple[EvalSummary, dict[str, float]]:
    """The summary and the `eval/*` metrics of one evaluation."""
    summary = summarize(per_prompt_rewards(trajectories, records, k), k=k, threshold=threshold)
    finished = [t for t in trajectories if t.status is TrajectoryStatus.FINISHED]
    metrics = summary.metrics() | {
        "eval/num_failed": float(len(records) * k - len(finished)),
        "eval/response_length_mean": sum(len(t.response_ids) for t in finished) / max(len(finished), 1),
        "eval/seconds": seconds,
    }
    return summary, metrics


def check_pinned(trajectories: list[Trajectory], policy_version: int) -> None:
    """Every sampled token of an evaluation comes from its one policy version (else it is a bug)."""
    mixed = [
        t.trajectory_id
        for t in trajectories
        if any(v != policy_version for v, m in zip(t.policy_versions, t.response_mask) if m)
    ]
    if mixed:
        raise AssertionError(f"evaluation of v{policy_version} holds tokens of other versions: {mixed[:5]}")


def write_rows(
    path: Path,
    trajectories: list[Trajectory],
    *,
    served_step: int,
    policy_version: int,
    started_elapsed_s: float,
    seconds: float,
) -> Path:
    """One row per held-out trajectory (parquet, written atomically)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamrl.core.atomic import atomic_write

    ordered = sorted(trajectories, key=lambda t: (prompt_id(t), t.sample_index))
    table = pa.table(
        {
            "policy_version": pa.array([policy_version] * len(ordered), pa.int64()),
            "served_step": pa.array([served_step] * len(ordered), pa.int64()),
            "prompt_id": pa.array([prompt_id(t) for t in ordered], pa.string()),
            "sample_index": pa.array([t.sample_index for t in ordered], pa.int32()),
            "reward": pa.array([t.reward for t in ordered], pa.float64()),
            "status": pa.array([str(t.status) for t in ordered], pa.string()),
            "finish_reason": pa.array([str(t.finish_reason) for t in ordered], pa.string()),
            "prompt_ids": pa.array([t.prompt_ids for t in ordered], pa.list_(pa.int32())),
            "response_ids": pa.array([t.response_ids for t in ordered], pa.list_(pa.int32())),
            "response_mask": pa.array([t.response_mask for t in ordered], pa.list_(pa.int8())),
            "num_tool_calls": pa.array([t.num_tool_calls for t in ordered], pa.int32()),
            "generate_s": pa.array([t.generate_s for t in ordered], pa.float64()),
            "finished_at": pa.array([t.finished_at for t in ordered], pa.float64()),
            "run_elapsed_s": pa.array([started_elapsed_s] * len(ordered), pa.float64()),  # when the evaluation began
            "eval_seconds": pa.array([seconds] * len(ordered), pa.float64()),
        }
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, sink.getvalue().to_pybytes(), sync=True)


def eval_file(run_dir: Path, served_step: int, policy_version: int) -> Path:
    return RunDir(run_dir).eval_file(served_step, policy_version)


def evaluated_steps(run_dir: Path) -> dict[int, Path]:
    """Served step -> its evaluation file, of every evaluation of the run (`RunDir.eval_files`)."""
    return {e.served_step: e.path for e in RunDir(run_dir).eval_files()}


@dataclasses.dataclass(kw_only=True)
class Evaluator:
    """Runs the evaluation schedule of one run segment (see the module docstring)."""

    cfg: StreamRLConfig
    run_dir: Path
    records: list[PromptRecord]
    done_steps: set[int] = dataclasses.field(default_factory=set)
    num_abandoned: int = 0
    _task: asyncio.Task | None = None

    @classmethod
    def open(cls, cfg: StreamRLConfig, run_dir: Path, training: list[PromptRecord]) -> Evaluator:
        records = heldout_records(cfg, training) if cfg.eval.enabled else []
        return cls(cfg=cfg, run_dir=Path(run_dir), records=records, done_steps=set(evaluated_steps(run_dir)))

    def due(self, served_step: int, *, final: bool = False) -> bool:
        """Whether the weights of `served_step` are evaluated: step 0, the last step (`final`: the run
        ends on them), and the first served step past each multiple of `every_steps` (sync_every
        need not divide it). Never twice."""
        if not self.records or served_step in self.done_steps:
            return False
        if final or served_step == 0 or served_step >= self.cfg.trainer.total_steps:
            return True
        every = self.cfg.eval.every_steps
        last = max((s for s in self.done_steps if s < served_step), default=0)
        return every > 0 and served_step // every > last // every

    def maybe_start(self, pipeline: Pipeline, *, final: bool = False) -> bool:
        """Start evaluating the weights the engines serve now, if they are due (at most one at a time:
        the caller holds the next sync until it ends)."""
        state = pipeline.state
        if not self.due(state.served_step, final=final):
            return False
        assert self._task is None or self._task.done(), "an evaluation is running: hold() before the next publish"
        self.done_steps.add(state.served_step)  # claimed: an abandoned one is not retried on other weights
        self._task = asyncio.create_task(
            self._evaluate(pipeline, state.served_step, state.policy_version), name=f"eval-step-{state.served_step}"
        )
        return True

    async def hold(self) -> float:
        """Wait for a running evaluation before the served version changes; past `eval.max_hold_s` it
        is cancelled and counted. Returns the seconds held. A failed evaluation raises here."""
        if self._task is None:
            return 0.0
        task, self._task, t0 = self._task, None, time.monotonic()
        done, _ = await asyncio.wait([task], timeout=self.cfg.eval.max_hold_s)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.num_abandoned += 1
            logger.warning(
                "evaluation %s outlived eval.max_hold_s=%.0f s: abandoned so the weight sync can go on",
                task.get_name(),
                self.cfg.eval.max_hold_s,
            )
            return time.monotonic() - t0
        task.result()  # surfaces a failed evaluation
        return time.monotonic() - t0

    async def drain(self) -> None:
        """The run's end: wait for a running evaluation without the bound (nothing will sync)."""
        task, self._task = self._task, None
        if task is not None:
            await task

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _evaluate(self, pipeline: Pipeline, served_step: int, policy_version: int) -> dict[str, float]:
        cfg = self.cfg
        engines = pipeline.serving_engines  # never a dropped or joining one
        started, t0 = pipeline.total_elapsed_s, time.monotonic()
        trajectories = await run_heldout(
            cfg, pipeline.model_path, engines, self.records, timeout_s=cfg.trainer.step_timeout_s
        )
        seconds = time.monotonic() - t0
        check_pinned(trajectories, policy_version)
        summary, metrics = heldout_metrics(
            trajectories, self.records, k=cfg.eval.k, threshold=cfg.eval.pass_threshold, seconds=seconds
        )
        metrics |= {
            "eval/served_step": float(served_step),
            "eval/elapsed_s": started,
            "eval/num_abandoned": float(self.num_abandoned),
        }
        write_rows(
            eval_file(self.run_dir, served_step, policy_version),
            trajectories,
            served_step=served_step,
            policy_version=policy_version,
            started_elapsed_s=started,
            seconds=seconds,
        )
        pipeline.metrics.log(metrics, learner_step=served_step, policy_version=policy_version, progress=False)
        passes = f"pass@1 {summary.pass_at_1:.3f}" + (
            f", pass@{summary.k} {summary.pass_at_k:.3f}" if summary.k > 1 else ""
        )
        logger.info(
            "held-out reward %.3f (avg@%d; %s) on %d prompts: weights of step %d (v%d), %.0f s",
            summary.avg_reward,
            summary.k,
            passes,
            summary.num_prompts,
            served_step,
            policy_version,
            seconds,
        )
        return metrics


def read_evaluation(path: Path) -> dict[str, float]:
    """Prompt id -> its mean reward over the samples of one evaluation file."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["prompt_id", "reward"]).to_pydict()
    by: dict[str, list[float]] = defaultdict(list)
    for pid, reward in zip(table["prompt_id"], table["reward"]):
        by[pid].append(reward)
    return {pid: sum(r) / len(r) for pid, r in by.items()}


def first_last_comparison(run_dir: Path):
    """The paired comparison of the run's first and last evaluation (`eval_stats.PairedComparison`),
    with the served steps it compares, or None with fewer than two evaluations."""
    from streamrl.streaming.eval_stats import compare

    files = evaluated_steps(run_dir)
    if len(files) < 2:
        return None
    first, last = min(files), max(files)
    return first, last, compare(read_evaluation(files[first]), read_evaluation(files[last]))


def summary_line(run_dir: Path) -> str | None:
    """`held-out reward 0.620 -> 0.750 (+0.130, 95% CI [...], mcnemar-exact p=0.003, ...)`."""
    found = first_last_comparison(run_dir)
    if found is None:
        return None
    first, last, result = found
    return f"  held-out     reward at step {first} -> step {last}: {result.line()}"
