"""`streamrl train --replay RUN_DIR [key=value ...]`: re-train on exactly the batches a run trained on.

The durable buffer is the record: its consumption log says which trajectories each learner step
used, in order (rollbacks after a resume already removed), and its trajectory log holds their rows
with every token's behaviour logprob and policy_version. Replay rebuilds each step's batch from
those, gives the learner the policy_version label the run's learner had at that step (from
RUN_DIR/metrics.jsonl: a resume relabels versions upward), and trains a fresh learner from the
run's starting weights: the arrival schedule of an async run, frozen, so two corrections or
learning rates can be compared on identical data. No Ray, no engines.

With the run's own settings on CPU the replay reproduces the original learner's losses bit for bit
(`tests/streaming/test_replay.py`). Writes RUN_DIR/replays/<name>/metrics.jsonl, one line per step
with the replayed metrics and the original loss, entropy and grad norm.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from streamrl.core.run_dir import RunDir
from streamrl.streaming.config import StreamRLConfig, apply_overrides

logger = logging.getLogger(__name__)

COMPARED = ("learner/loss", "learner/pg_loss", "learner/entropy", "learner/grad_norm")


def logged_batches(buffer_dir: Path) -> list[tuple[int, pa.Table, np.ndarray]]:
    """(learner_step, rows in the order the batch had, trajectory lags) of every step the run trained:
    the rows the buffer kept (`buffer.cli.logged_steps`)."""
    from streamrl.buffer.cli import logged_steps

    table, steps = logged_steps(buffer_dir)
    return [
        (step, table.take(np.array([r for r, _ in rows])), np.array([lag for _, lag in rows]))
        for step, rows in sorted(steps.items())
    ]


def _logged_steps(run_dir: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    run = RunDir(run_dir)
    for record in run.metric_records() if run.metrics.exists() else []:
        if "learner/loss" in record:
            out[int(record["learner_step"])] = record  # a resumed step logged twice: the last one counts
    return out


def replay(run_dir: str | Path, overrides: list[str] | None = None, *, name: str | None = None) -> list[dict[str, Any]]:
    """Train a fresh learner on the run's logged batches; returns one record per step."""
    import torch

    from streamrl.buffer.padding import pad_table
    from streamrl.learner.engine import TrainingEngine

    run = RunDir.open(run_dir)
    info = run.info()
    cfg = StreamRLConfig.model_validate(apply_overrides(info.config, list(overrides or [])))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))  # as the learner actor
    engine = TrainingEngine(cfg.learner.model_copy(update={"model": info.model_path}))
    original = _logged_steps(run.root)
    metrics_path = run.replay_metrics(name or time.strftime("%Y%m%d-%H%M%S"))
    out_dir = metrics_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    with open(metrics_path, "w") as f:
        for step, rows, _lags in logged_batches(run.buffer):
            logged = original.get(step, {})
            if "learner/policy_version" in logged:  # the label the run's learner gave this step's result
                engine.policy_version = int(logged["learner/policy_version"]) - 1
            metrics = engine.train_step(pad_table(rows))
            record = {"learner_step": step, **metrics, **{f"original/{k}": logged.get(k) for k in COMPARED}}
            records.append(record)
            f.write(json.dumps(record) + "\n")
            logger.info(
                "replay step %d: loss %.6g (original %s)", step, metrics["learner/loss"], logged.get("learner/loss")
            )
    (out_dir / "overrides.json").write_text(json.dumps(list(overrides or [])))
    return records


def replay_main(run_dir: str, overrides: list[str]) -> int:
    records = replay(run_dir, overrides)
    same = sum(all(r[k] == r[f"original/{k}"] for k in COMPARED) for r in records)
    print(
        f"replayed {len(records)} steps of {run_dir}: loss, entropy and grad norm identical to the original "
        f"at {same} of them" + (" (settings changed by overrides)" if overrides else "")
    )
    return 0
