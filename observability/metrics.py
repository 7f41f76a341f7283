"""Run observability: the metrics log, the utilization timeline, trajectory samples, wandb, progress.

The driver owns one `MetricsLogger` per run directory and is its only writer. Everything it writes is
append-only JSONL, one object per line, flushed line by line so a SIGKILL loses at most the line
being written; a resumed run appends to the same files (`streamrl report` reads them, see report.py):

- `metrics.jsonl`  {"time": unix_s, "elapsed_s", "learner_step", "policy_version", <metrics>}
- `timeline.jsonl` {"kind": SpanKind, "who": "engine-0" | "learner" | ..., "start", "end"}; times are
  elapsed seconds since the run's `started_at` (from its `RunInfo`, so a resumed run keeps one clock)
- `samples.jsonl`  `Trajectory.to_dict()` + {"learner_step"}

Metric conventions: keys are `<namespace>/<name>` with the namespaces `rollout`,
`buffer`, `learner`, `staleness`, `is`, `sync`, `engine`; `rollout/num_*` counts are per interval
(since the previous log call that carried them), so their sum is the run total; fractions lie in
[0, 1]; durations are seconds. `engine/busy_fraction` is the mean over engines and
`engine/busy_fraction/<engine_id>` the per-engine value; per-lag breakdowns end in `/lag_<k>`.

wandb mirrors every record (offline unless the user asks for online) and is a fault boundary: a
wandb failure is logged, counted in `metrics/num_wandb_errors`, and never stops the run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.text import Text

from streamrl.core import catalogue
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.observability.logs import PROGRESS_EXTRA, format_duration
from streamrl.observability.logs import console as shared_console

if TYPE_CHECKING:
    from streamrl.rollout.types import Trajectory

logger = logging.getLogger(__name__)

RESERVED_KEYS = catalogue.RESERVED

# Keys the progress line and the report summary read (declared in core/catalogue.py).
REWARD_KEY = catalogue.REWARD
LAG_KEY = catalogue.LAG
ENGINE_BUSY_KEY = catalogue.ENGINE_BUSY
ROLLOUT_TOKENS_PER_S_KEY = catalogue.ROLLOUT_TOKENS_PER_S
WANDB_ERRORS_KEY = catalogue.WANDB_ERRORS


class SpanKind(StrEnum):
    GENERATE = "generate"
    TOOL = "tool"
    TRAIN = "train"
    SYNC = "sync"
    IDLE = "idle"


class WandbMode(StrEnum):
    OFFLINE = "offline"
    ONLINE = "online"
    DISABLED = "disabled"


class WandbConfig(BaseModel):
    """wandb mirror of the metrics log. Never online unless asked: `mode="online"` or WANDB_MODE."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    mode: WandbMode | None = None  # None: $WANDB_MODE when set, else offline
    project: str = Field(default="streamrl", min_length=1)
    entity: str | None = None
    name: str | None = None  # default: the run name
    tags: list[str] = Field(default_factory=list)
    dir: str | None = None  # default: $WANDB_DIR, else the run directory


def resolve_wandb_mode(cfg: WandbConfig | None, environ: Mapping[str, str] = os.environ) -> WandbMode:
    """Explicit config wins, then $WANDB_MODE, then offline. Disabled when `enabled` is false."""
    if cfg is None or not cfg.enabled:
        return WandbMode.DISABLED
    if cfg.mode is not None:
        return cfg.mode
    env = environ.get("WANDB_MODE", "").strip().lower()
    aliases = {"run": WandbMode.ONLINE, "dryrun": WandbMode.OFFLINE}
    if env in aliases:
        return aliases[env]
    if env in WandbMode.__members__.values():
        return WandbMode(env)
    if env:
        logger.warning("unknown WANDB_MODE=%r; using offline", env)
    return WandbMode.OFFLINE


def summarize(
    values: Iterable[float], *, prefix: str = "", quantiles: Iterable[float] = (0.5, 0.9, 0.99)
) -> dict[str, float]:
    """Mean/std/min/max and quantiles (`p50`...) of `values` as `{prefix+stat: value}`; {} if empty."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return {}
    out = {
        f"{prefix}mean": float(arr.mean()),
        f"{prefix}std": float(arr.std()),
        f"{prefix}min": float(arr.min()),
        f"{prefix}max": float(arr.max()),
    }
    for q in quantiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q} outside [0, 1]")
        out[f"{prefix}p{round(q * 100):d}"] = float(np.quantile(arr, q))
    return out


def _clean_value(key: str, value: Any) -> float | None:
    if value is None:  # "not measured this interval" (e.g. the mean of nothing)
        return None
    if isinstance(value, bool | int | float | np.integer | np.floating):
        number = float(value)
        return number if math.isfinite(number) else None  # JSON has no NaN; the report reads null
    if callable(getattr(value, "item", None)):  # 1-element arrays and tensors, without importing torch
        try:
            return _clean_value(key, value.item())
        except (ValueError, RuntimeError):
            pass
    raise ValueError(f"metric {key!r} must be a number, got {type(value).__name__}")


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Validate namespaced keys and numeric values (None allowed); non-finite numbers become None."""
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or "/" not in key.strip("/") or key in RESERVED_KEYS:
            raise ValueError(f"metric key {key!r} must be namespaced like 'rollout/reward_mean' (<namespace>/<name>)")
        out[key] = _clean_value(key, value)
    return out


def format_vitals(latest: Mapping[str, float | None]) -> str:
    """The progress line's text from the latest known value of each vital."""
    parts = []
    if (reward := latest.get(REWARD_KEY)) is not None:
        parts.append(f"reward {reward:.3f}")
    if (lag := latest.get(LAG_KEY)) is not None:
        parts.append(f"lag {lag:.2f}")
    busy = latest.get(ENGINE_BUSY_KEY)
    if busy is None:
        per_engine = [v for k, v in latest.items() if k.startswith(ENGINE_BUSY_KEY + "/") and v is not None]
        busy = sum(per_engine) / len(per_engine) if per_engine else None
    if busy is not None:
        parts.append(f"busy {busy:.0%}")
    if (tps := latest.get(ROLLOUT_TOKENS_PER_S_KEY)) is not None:
        parts.append(f"{tps / 1000:.1f}k tok/s" if tps >= 1000 else f"{tps:.0f} tok/s")
    if (version := latest.get("policy_version")) is not None:
        parts.append(f"v{int(version)}")
    return " · ".join(parts)


class _JsonlWriter:
    """Append-only JSONL file, one flush per line. A torn last line from a killed run is fenced off
    with a newline so the next record starts clean (readers skip the torn one)."""

    def __init__(self, path: Path) -> None:
        torn = False
        if path.exists() and path.stat().st_size > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._file = open(path, "a", encoding="utf-8")
        if torn:
            self._file.write("\n")
            self._file.flush()
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def eta_s(first: tuple[int, float] | None, step: int, now: float, total_steps: int | None) -> float | None:
    """Seconds left at the mean pace since `first` = (step, monotonic time) this process first saw;
    None until two steps are known (the first one carries the start-up time)."""
    if first is None or total_steps is None or step <= first[0]:
        return None
    return (now - first[1]) / (step - first[0]) * max(total_steps - step, 0)


def progress_line(latest: Mapping[str, float | None], *, total_steps: int | None, eta: float | None) -> str:
    """`step 3/16 · reward 0.620 · lag 1.80 · busy 56% · 310 tok/s · v3 · 2:11 elapsed · eta 9:40`."""
    step = f"step {int(latest.get('learner_step') or 0)}" + (f"/{total_steps}" if total_steps else "")
    parts = [step, format_vitals(latest)]
    if (elapsed := latest.get("elapsed_s")) is not None:
        parts.append(f"{format_duration(elapsed)} elapsed")
    if eta is not None:
        parts.append(f"eta {format_duration(eta)}")
    return " · ".join(p for p in parts if p)


class _Progress:
    """The console's view of a run: a rich progress bar on a terminal (step/total, vitals, elapsed,
    ETA), else one concise line per step (CI logs, pipes). The per-step line always goes to the log
    (`RUN_DIR/logs/driver.log`); the console drops it while the bar shows the same numbers."""

    def __init__(self, *, total_steps: int | None, elapsed_s: float) -> None:
        self._latest: dict[str, float | None] = {}
        self._total_steps = total_steps
        self._first: tuple[int, float] | None = None
        self._bar = None
        if shared_console().is_terminal:
            self._bar = Progress(
                TextColumn("[bold]step"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("{task.fields[vitals]}", markup=False),
                _ClockColumn(),
                console=shared_console(),
                refresh_per_second=2,
            )
            self._task = self._bar.add_task(
                "train",
                total=total_steps,
                vitals="starting engines and learner",
                elapsed=elapsed_s,
                eta=None,
                at=time.monotonic(),
            )
            self._bar.start()

    def update(self, record: Mapping[str, Any]) -> None:
        self._latest.update({k: v for k, v in record.items() if v is not None})
        step, now = int(record["learner_step"]), time.monotonic()
        if self._first is None:
            self._first = (step, now)
        eta = eta_s(self._first, step, now, self._total_steps)
        logger.info("%s", progress_line(self._latest, total_steps=self._total_steps, eta=eta), extra=PROGRESS_EXTRA)
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=step,
                vitals=format_vitals(self._latest),
                elapsed=float(record.get("elapsed_s") or 0.0),
                eta=eta,
                at=now,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class _ClockColumn(ProgressColumn):
    """Run time and ETA, ticking between steps from the values the last step set."""

    def render(self, task: Any) -> Text:
        since = time.monotonic() - task.fields["at"]
        text = f"{format_duration(task.fields['elapsed'] + since)} elapsed"
        if task.fields["eta"] is not None:
            text += f" · eta {format_duration(max(task.fields['eta'] - since, 0.0))}"
        return Text(text, style="progress.elapsed")


class MetricsLogger:
    """Writes a run's metrics, timeline spans and trajectory samples; mirrors metrics to wandb.

    `started_at` (unix seconds) is the timeline's zero: by default the run's `RunInfo`'s, so a
    resumed run continues the same clock, else now. Thread-safe for concurrent `log`/`span` calls.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb_cfg: WandbConfig | None,
        console: bool,
        total_steps: int | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        started_at: float | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        info = self._read_run_info()
        self.started_at = started_at if started_at is not None else (info.started_at if info else time.time())
        self.run_name = run_name or (info.run_name if info else "") or self.run_dir.name
        self.num_wandb_errors = 0
        paths = RunDir(self.run_dir)
        self._metrics = _JsonlWriter(paths.metrics)
        self._timeline = _JsonlWriter(paths.timeline)
        self._samples = _JsonlWriter(paths.samples)
        self._progress = _Progress(total_steps=total_steps, elapsed_s=self.elapsed()) if console else None
        self._wandb_run = None
        self._closed = False
        mode = resolve_wandb_mode(wandb_cfg)
        if wandb_cfg is not None and mode is not WandbMode.DISABLED:
            saved = info.config if info else None
            self._wandb_run = self._init_wandb(wandb_cfg, mode, config if config is not None else saved)

    # -- clock ---------------------------------------------------------------------------------

    def elapsed(self, at: float | None = None) -> float:
        """Seconds since `started_at` of the unix time `at` (default now): the timeline's clock."""
        return (time.time() if at is None else at) - self.started_at

    # -- records -------------------------------------------------------------------------------

    def log(self, metrics: Mapping[str, Any], *, learner_step: int, policy_version: int, progress: bool = True) -> None:
        """Append one record; raises ValueError for un-namespaced keys or non-numeric values. A record
        that is not a step's (`progress=False`, e.g. a held-out evaluation) leaves the progress line alone."""
        if learner_step < 0 or policy_version < 0:
            raise ValueError(f"learner_step ({learner_step}) and policy_version ({policy_version}) must be >= 0")
        now = time.time()
        record: dict[str, Any] = {
            "time": now,
            "elapsed_s": round(self.elapsed(now), 6),
            "learner_step": int(learner_step),
            "policy_version": int(policy_version),
            **clean_metrics(metrics),
        }
        if self.num_wandb_errors:
            record[WANDB_ERRORS_KEY] = self.num_wandb_errors
        self._metrics.write(record)
        if self._wandb_run is not None:
            self._wandb_call("log", lambda: self._wandb_run.log({k: v for k, v in record.items() if v is not None}))
        if progress and self._progress is not None:
            self._progress.update(record)

    def span(self, kind: SpanKind | str, who: str, start: float, end: float) -> None:
        """Record that `who` spent [start, end] (elapsed seconds, see `elapsed`) on `kind`."""
        try:
            kind = SpanKind(kind)
        except ValueError:
            raise ValueError(f"span kind {kind!r} is not one of {[k.value for k in SpanKind]}") from None
        if not who:
            raise ValueError("span needs a non-empty `who` (e.g. 'engine-0', 'learner')")
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"span [{start}, {end}] of {who}/{kind} must be finite with end >= start")
        self._timeline.write({"kind": kind.value, "who": who, "start": round(start, 6), "end": round(end, 6)})

    @contextmanager
    def timed(self, kind: SpanKind | str, who: str) -> Iterator[None]:
        """`with logger.timed("train", "learner"): ...` records the block as a span, even if it raises."""
        start = self.elapsed()
        try:
            yield
        finally:
            self.span(kind, who, start, self.elapsed())

    def sample(self, traj: Trajectory, learner_step: int) -> None:
        """Keep one trajectory for the report's viewer (the driver chooses which and how many)."""
        row = traj.to_dict()
        row["learner_step"] = int(learner_step)
        self._samples.write(row)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.close()
        if self._wandb_run is not None:
            self._wandb_call("finish", self._wandb_run.finish)
            self._wandb_run = None
        for writer in (self._metrics, self._timeline, self._samples):
            writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _read_run_info(self) -> RunInfo | None:
        """The run's `RunInfo`; None (defaults) before the driver wrote it, or when it is unreadable."""
        run = RunDir(self.run_dir)
        if not run.run_info.exists():
            return None
        try:
            return run.info()
        except (OSError, ValueError) as exc:
            logger.warning("unreadable %s (%s); using defaults", run.run_info, exc)
            return None

    def _init_wandb(self, cfg: WandbConfig, mode: WandbMode, config: Mapping[str, Any] | None) -> Any:
        """Start (or resume, by the id saved in the run dir) the wandb run; None if wandb fails."""
        id_path = RunDir(self.run_dir).wandb_id
        try:
            import wandb

            run_id = id_path.read_text().strip() if id_path.exists() else uuid.uuid4().hex[:8]
            run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name or self.run_name,
                tags=list(cfg.tags),
                config=dict(config or {}),
                dir=cfg.dir or os.environ.get("WANDB_DIR") or str(self.run_dir),
                mode=mode.value,
                id=run_id,
                resume="allow",
                settings=wandb.Settings(console="off", silent=True),
            )
            run.define_metric("learner_step")
            run.define_metric("*", step_metric="learner_step")
            id_path.write_text(run_id)
            logger.info("wandb %s run %s in %s", mode.value, run_id, run.dir)
            return run
        except Exception as exc:  # fault boundary: observability never stops training
            self.num_wandb_errors += 1
            logger.warning("wandb init failed (%s: %s); continuing without wandb", type(exc).__name__, exc)
            return None

    def _wandb_call(self, what: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:  # fault boundary: observability never stops training
            self.num_wandb_errors += 1
            if self.num_wandb_errors == 1 or self.num_wandb_errors % 100 == 0:
                logger.warning("wandb %s failed (%d so far): %s", what, self.num_wandb_errors, exc)
