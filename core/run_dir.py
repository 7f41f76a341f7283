"""The run directory: every path of `RUN_DIR` named once, the records a run leaves there as types, and
the one rule for a complete checkpoint. Every reader of a run (the CLIs, the report, the trace, the
simulator, replay, bench) goes through `RunDir`; no other module spells a run file's name.

    RUN_DIR/
      run_info.json        the resolved config, the model folder, the prompts' fingerprint (`RunInfo`)
      driver_state.json    learner step, served version and its label offset, cursor, checkpoints kept
      placement.json       which node runs which part
      accounting.json      the end-of-run accounting of every admitted trajectory (`Accounting`)
      scale_request.json   `streamrl scale`: the engine count wanted, engines to drain (the driver polls it)
      metrics.jsonl, timeline.jsonl, samples.jsonl, wandb_run_id
      buffer/              the replay buffer's durable log
      checkpoints/step_NNNNNN/   sealed learner checkpoints (`Checkpoint`)
      eval/                version-pinned held-out evaluations (`EvalFile`: step_<served>-v<version>.parquet)
      eval_offline/        `streamrl eval` results
      logs/                driver.log, one file per actor, prepare_model.log, ray/
      staleness/, staleness.json, staleness.html, replays/, tool_ledger.jsonl, answer_ledger.jsonl, report.html
      trace/               the lifecycle trace, one shard per process (core.trace); trace.json merged

A folder is a run iff it holds run_info.json: `RunDir.open` and `RunDir.info` raise `NotARunDirError`
(a ValueError, the one "not a run directory" error) otherwise. A checkpoint is complete iff it is
sealed (`core.atomic.unsealed_reason`: its manifest and every file at its size): the learner seals
it before renaming it into place, so a folder that is there but not sealed was torn by a lost
machine or a damaged disk (`why_incomplete`, the one rule). An evaluation file is written
atomically, so every one there is whole. `DriverState` is defined by the driver that owns it
(`streaming.driver_state`); this module says where it lives.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypedDict

from streamrl.core.atomic import atomic_write, unsealed_reason

CHECKPOINT_PREFIX = "step_"
CHECKPOINT_HF = "hf"  # inside a checkpoint: the weights, config and tokenizer an engine loads
CHECKPOINT_STATE = "state.json"  # inside a checkpoint: the learner's policy_version, step count, config
EVAL_SUFFIX = ".parquet"


class NotARunDirError(ValueError):
    """The folder holds no run: it has no run_info.json."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RunInfo:
    """`RUN_DIR/run_info.json`: what a run is, written once by the driver when the run starts (a resume
    keeps it). `config` is the resolved root config as JSON: `StreamRLConfig.model_validate(info.config)`."""

    run_name: str
    model_path: str  # HF folder the run started from, tokenizer included (the viewer decodes with it)
    mode: str  # "async" | "sync"
    config: dict[str, Any] = field(default_factory=dict)  # the resolved root config
    started_at: float = field(default_factory=time.time)  # unix seconds; the timeline's zero
    prompts_sha256: str | None = None  # the training prompts' fingerprint (streaming.resume); None: not recorded
    num_prompts: int | None = None

    REQUIRED: ClassVar[tuple[str, ...]] = ("run_name", "model_path", "mode", "config")  # the rest have defaults

    @classmethod
    def from_dict(cls, data: Any, *, where: Path | str = "run_info.json") -> RunInfo:
        """The record in `data` (unknown keys are ignored); ValueError naming what is missing."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} is not a JSON object")
        missing = [k for k in cls.REQUIRED if k not in data]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
        if not isinstance(data["config"], dict):
            raise ValueError(f"{where}: config is not a JSON object")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Accounting(TypedDict):
    """`RUN_DIR/accounting.json`: I2 at the end of a run (`Pipeline.write_accounting`)."""

    learner_step: int
    stranded: list[str]  # resumable in the buffer, held by no worker
    untracked: list[str]  # held by a worker, without a partial row in the buffer
    resumable: list[str]


ACCOUNTING_KEYS = ("learner_step", "stranded", "untracked", "resumable")


def why_incomplete(folder: Path) -> str | None:
    """The one rule for a complete checkpoint: None when `folder` is sealed and whole, else why not."""
    return unsealed_reason(Path(folder))


@dataclass(kw_only=True, slots=True, frozen=True)
class Checkpoint:
    """One `checkpoints/step_NNNNNN` folder (written and sealed by `learner.checkpoint`)."""

    step: int  # learner step of its weights
    path: Path

    @classmethod
    def at(cls, path: str | Path) -> Checkpoint:
        """The checkpoint folder `path` (its step read from its name); ValueError if not named like one."""
        step = _step_of(Path(path).name)
        if step is None:
            raise ValueError(f"{path} is not a checkpoint folder ({CHECKPOINT_PREFIX}NNNNNN)")
        return cls(step=step, path=Path(path))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def hf(self) -> Path:
        """The weights, config and tokenizer an engine loads."""
        return self.path / CHECKPOINT_HF

    @property
    def state_file(self) -> Path:
        return self.path / CHECKPOINT_STATE

    def why_incomplete(self) -> str | None:
        return why_incomplete(self.path)


@dataclass(kw_only=True, slots=True, frozen=True)
class EvalFile:
    """One held-out evaluation, `eval/step_<served step>-v<policy_version>.parquet` (streaming.heldout)."""

    served_step: int  # learner step of the weights evaluated
    policy_version: int  # their version label
    path: Path


def _step_of(name: str) -> int | None:
    digits = name.removeprefix(CHECKPOINT_PREFIX)
    return int(digits) if name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @classmethod
    def open(cls, root: str | Path) -> RunDir:
        """The run at `root`; `NotARunDirError` if it holds none."""
        run = cls(root)
        run.check()
        return run

    def check(self) -> None:
        if not self.run_info.exists():
            raise NotARunDirError(f"{self.root} is not a streamrl run directory (no {self.run_info.name})")

    def started_parts(self) -> list[str]:
        """What of a started run this folder holds (empty for a folder no run has used)."""
        return [p.name for p in (self.run_info, self.driver_state, self.buffer) if p.exists()]

    # ---- records -------------------------------------------------------------------------------------
    def info(self) -> RunInfo:
        """run_info.json; `NotARunDirError` without one, ValueError when it is not a whole record."""
        self.check()
        return RunInfo.from_dict(read_json(self.run_info), where=self.run_info)

    def write_info(self, info: RunInfo) -> Path:
        return write_json(self.run_info, info.to_dict(), indent=2)

    def accounting_record(self) -> Accounting | None:
        """accounting.json, or None when the run ended without one (killed); ValueError if torn."""
        if not self.accounting.exists():
            return None
        data = read_json(self.accounting)
        missing = [k for k in ACCOUNTING_KEYS if not isinstance(data, dict) or k not in data]
        if missing:
            raise ValueError(f"{self.accounting} lacks {', '.join(missing)}")
        return Accounting(
            learner_step=data["learner_step"],
            stranded=data["stranded"],
            untracked=data["untracked"],
            resumable=data["resumable"],
        )

    def write_accounting(self, accounting: Accounting) -> Path:
        return write_json(self.accounting, accounting)

    # ---- record files (JSON, atomic) -----------------------------------------------------------------
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

    # ---- logs of the run -----------------------------------------------------------------------------
    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    def metric_records(self) -> list[dict[str, Any]]:
        """Every line of metrics.jsonl (steps and evaluations), in order."""
        return read_jsonl(self.metrics)

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

    @property
    def trace(self) -> Path:
        """The lifecycle trace's shards, one per process (core.trace)."""
        return self.root / "trace"

    @property
    def trace_json(self) -> Path:
        """The merged Chrome trace (`streamrl trace`)."""
        return self.root / "trace.json"

    # ---- checkpoints ---------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:06d}"

    def checkpoint_folders(self) -> list[Checkpoint]:
        """Every `checkpoints/step_NNNNNN` folder, oldest first, complete or not."""
        found = [(_step_of(p.name), p) for p in self.checkpoints.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir()]
        return sorted((Checkpoint(step=s, path=p) for s, p in found if s is not None), key=lambda c: c.step)

    def complete_checkpoints(self) -> list[Checkpoint]:
        """The complete checkpoints (`why_incomplete`), oldest first."""
        return [c for c in self.checkpoint_folders() if c.why_incomplete() is None]

    # ---- evaluations ---------------------------------------------------------------------------------
    @property
    def eval(self) -> Path:
        return self.root / "eval"

    def eval_file(self, served_step: int, policy_version: int) -> Path:
        return self.eval / f"{CHECKPOINT_PREFIX}{served_step:06d}-v{policy_version:06d}{EVAL_SUFFIX}"

    def eval_files(self) -> list[EvalFile]:
        """Every held-out evaluation of the run, by served step."""
        out = []
        for path in self.eval.glob(f"{CHECKPOINT_PREFIX}*-v*{EVAL_SUFFIX}"):
            step, _, version = path.name.removesuffix(EVAL_SUFFIX).partition("-v")
            if (served := _step_of(step)) is not None and version.isdigit():
                out.append(EvalFile(served_step=served, policy_version=int(version), path=path))
        return sorted(out, key=lambda e: (e.served_step, e.path.name))

    @property
    def eval_offline(self) -> Path:
        return self.root / "eval_offline"

    # ---- other folders -------------------------------------------------------------------------------
    @property
    def buffer(self) -> Path:
        return self.root / "buffer"

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

    def replay_metrics(self, name: str) -> Path:
        """`streamrl train --replay`'s metrics of the replay `name`, one line per step."""
        return self.replays / name / "metrics.jsonl"

    @property
    def report(self) -> Path:
        return self.root / "report.html"


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file, one a line (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_json(path: Path, data: Any, *, indent: int | None = 1) -> Path:
    """Write `data` as JSON atomically, fsynced with its folder (survives a power loss)."""
    return atomic_write(Path(path), json.dumps(data, indent=indent), sync=True)
