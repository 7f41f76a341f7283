"""What `streamrl train --resume RUN_DIR key=value ...` may change, and the training prompts' fingerprint.

A resumed run goes on with the state it left: the data cursor counts prompts of one ordered stream,
trajectory and group ids name (prompt, epoch, sample), and the buffer's recovered groups expect
`buffer.group_size` members. An override that changes the prompt stream (`data.*`: another seed
reorders it, so the cursor skips some prompts and repeats others), the group layout
(`buffer.group_size`: recovered groups never complete), the model or the algorithm would continue a
different run on this one's state. Those are refused, all in one error; start a new run instead.

Allowed (`SAFE_ON_RESUME`) are knobs that change how long, how fast or how much memory, never what
is trained on:
- trainer: total_steps, timeouts, checkpoint cadence and retention, sample logging, the failure stop;
- wandb.* (logging only); eval.every_steps and eval.max_hold_s (when, not what: the held-out set,
  k, temperature and pass threshold stay, so the run's evaluations stay comparable);
- the memory and throughput knobs an out-of-memory stop names for its `--resume` (streaming/errors.py):
  engine KV cache / GPU share, number of engines and workers, concurrency, learner micro-batching,
  buffer capacity and batch size (whole groups either way; only the number per step changes).

An override that sets a refused key to the value the run already has is no change and passes.

The prompts themselves: `prompts_sha256` of the records the run trains on is stored in
its `RunInfo` when it starts; a resume recomputes it from the (unchanged) data config and refuses a
dataset file (or generator) that changed under the run.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.streaming.config import StreamRLConfig, apply_overrides

if TYPE_CHECKING:
    from streamrl.rollout.types import PromptRecord

logger = logging.getLogger(__name__)

# Exact keys, or prefixes ending in "." for a whole section.
SAFE_ON_RESUME: tuple[str, ...] = (
    "trainer.total_steps",
    "trainer.step_timeout_s",
    "trainer.actor_timeouts.",
    "trainer.stall_timeout_s",
    "trainer.checkpoint_every",
    "trainer.async_checkpoint",
    "rollout.agent.progress_every_s",
    "trainer.keep_checkpoints",
    "trainer.log_samples_every",
    "trainer.max_failed_fraction",
    "trainer.failed_window",
    "wandb.",
    "eval.every_steps",
    "eval.max_hold_s",
    "rollout.engine.kv_cache_space_gb",
    "rollout.engine.gpu_memory_utilization",
    "rollout.engine.startup_timeout_s",
    "rollout.num_engines",
    "rollout.num_workers",
    "rollout.max_concurrent_per_worker",
    "learner.micro_batch_tokens",
    "learner.logits_chunk_tokens",
    "learner.gradient_checkpointing",
    "learner.max_nonfinite_steps",
    "buffer.capacity_rows",
    "buffer.batch_size",
)


def safe_on_resume(key: str) -> bool:
    return any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in SAFE_ON_RESUME)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix.removesuffix("."): data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def resume_config(run_dir: str | Path, overrides: list[str]) -> tuple[StreamRLConfig, RunInfo]:
    """The config a resume of `run_dir` runs with (its saved one plus `overrides`) and its `RunInfo`.
    Raises ValueError naming every override that would change what the run trains on."""
    info = RunDir(run_dir).info()
    saved = StreamRLConfig.model_validate(copy.deepcopy(info.config))
    cfg = StreamRLConfig.model_validate(apply_overrides(copy.deepcopy(info.config), overrides))
    before, after = _flatten(saved.model_dump(mode="json")), _flatten(cfg.model_dump(mode="json"))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k) and not safe_on_resume(k))
    if changed:
        lines = ", ".join(f"{k} ({before.get(k)!r} -> {after.get(k)!r})" for k in changed)
        raise ValueError(
            f"--resume {run_dir} cannot change {lines}: the run's saved state (data cursor, group ids, buffer "
            "groups, checkpoints) belongs to its own prompts, groups, model and algorithm. Start a new run "
            "for that; a resume may change only how long, how fast or with how much memory it runs "
            f"({', '.join(SAFE_ON_RESUME)})"
        )
    return cfg, info


def prompts_sha256(records: list[PromptRecord]) -> str:
    """Fingerprint of the training prompts, in dataset order (every field of every record)."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(asdict(record), sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def check_prompts(run_dir: str | Path, info: RunInfo, records: list[PromptRecord]) -> None:
    """Refuse to resume on prompts other than those the run started with (a dataset file rewritten
    under the run). A run from before the fingerprint was recorded is resumed with a warning."""
    expected = info.prompts_sha256
    if expected is None:
        where = RunDir(run_dir).run_info
        logger.warning("%s records no prompts_sha256: cannot check the dataset did not change", where)
        return
    found = prompts_sha256(records)
    then = info.num_prompts if info.num_prompts is not None else "?"
    if found != expected:
        raise ValueError(
            f"--resume {run_dir}: the training prompts changed since the run started ({len(records)} records now, "
            f"{then} then; sha256 {found[:12]} != {expected[:12]}): the data cursor would "
            "point into another dataset. Restore the dataset the run started with, or start a new run"
        )
