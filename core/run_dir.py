"""The run directory: every path of `RUN_DIR` named once, and its JSON records read and written
atomically (write-then-rename, fsynced with the folder, `core.atomic`).

    RUN_DIR/
      run_info.json        the resolved config, the model folder, the prompts' fingerprint
      driver_state.json    learner step, served version and its label offset, cursor, checkpoints kept
      placement.json       which node runs which part
      accounting.json      the end-of-run accounting of every admitted trajectory
      scale_request.json   `streamrl scale`: the engine count wanted, engines to drain (the driver polls it)
      metrics.jsonl, timeline.jsonl, samples.jsonl, wandb_run_id
      buffer/              the replay buffer's durable log
      checkpoints/step_NNNNNN/   sealed learner checkpoints
      eval/                version-pinned held-out evaluations (step_<served>-v<version>.parquet)
      eval_offline/        `streamrl eval` results
      logs/                driver.log, one file per actor, prepare_model.log, ray/
      staleness/, staleness.json, staleness.html, replays/, tool_ledger.jsonl, answer_ledger.jsonl, report.html
      trace/               the lifecycle trace, one shard per process (core.trace); trace.json merged

The records themselves (`DriverState`, `RunInfo`, the accounting) are defined by the parts that
own them; this module only says where each one lives and moves JSON to and from disk safely.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.core.atomic import atomic_write

CHECKPOINT_PREFIX = "step_"


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    # ---- records (JSON, atomic) -------------------------------------------------------------------
    @property
    def run_info(self) -> Path:
        return self.root / "run_info.json"

    @property
    def driver_state(self) -> Path:
        return self.root / "driver_state.json"

    @property
    def placement(self) -> Path:
        return self.root / "placement.json"

    @property
    def accounting(self) -> Path:
        return self.root / "accounting.json"

    @property
    def scale_request(self) -> Path:
        return self.root / "scale_request.json"

    # ---- logs of the run ---------------------------------------------------------------------------
    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def timeline(self) -> Path:
        return self.root / "timeline.jsonl"

    @property
    def samples(self) -> Path:
        return self.root / "samples.jsonl"

    @property
    def wandb_id(self) -> Path:
        return self.root / "wandb_run_id"

    @property
    def tool_ledger(self) -> Path:
        return self.root / "tool_ledger.jsonl"

    @property
    def answer_ledger(self) -> Path:
        return self.root / "answer_ledger.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    # ---- folders -------------------------------------------------------------------------------------
    @property
    def buffer(self) -> Path:
        return self.root / "buffer"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:06d}"

    def checkpoint_dirs(self) -> list[Path]:
        """Every `checkpoints/step_*` folder, oldest first (complete or not: see `streaming.checkpoints`)."""
        return sorted(self.checkpoints.glob(f"{CHECKPOINT_PREFIX}*"))

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def eval_offline(self) -> Path:
        return self.root / "eval_offline"

    @property
    def staleness(self) -> Path:
        return self.root / "staleness"

    @property
    def staleness_json(self) -> Path:
        return self.root / "staleness.json"

    @property
    def staleness_html(self) -> Path:
        return self.root / "staleness.html"

    @property
    def replays(self) -> Path:
        return self.root / "replays"

    @property
    def report(self) -> Path:
        return self.root / "report.html"


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def write_json(path: Path, data: Any, *, indent: int | None = 1) -> None:
    """Write `data` as JSON atomically, fsynced with its folder (survives a power loss)."""
    atomic_write(Path(path), json.dumps(data, indent=indent), sync=True)
