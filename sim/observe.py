"""What calibration reads of a run: `Observations`, one source-independent record per run.

`from_metrics(run_dir)` fills it from what every run writes today: the per-step metrics lines
(RUN_DIR/metrics.jsonl: learner step time, sync times, the idle clock, engine busy seconds), the
timeline's learner spans (RUN_DIR/timeline.jsonl: when the learner trained) and the durable buffer
(per trajectory: assistant turns, the tokens of each turn from its response mask, generation seconds,
when it was created and finished, the step that consumed it). A lifecycle trace (per-request
generate spans, per-call tool spans) would fill the same fields more directly — per turn instead of
per trajectory — through a second constructor beside this one; the fits (`sim.calibrate`) read only
`Observations`.

Times are on the pipeline's clock (seconds since the run's pipeline started), the clock of the
timeline and of `time/elapsed_s`; the buffer's unix times are moved onto it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.buffer.cli import load_frame
from streamrl.core.run_dir import RunDir, read_jsonl

# the metrics keys calibration reads (all declared in core/catalogue.py)
ELAPSED = "time/elapsed_s"
STEP_S = "learner/step_s"
IDLE_RATIO = "learner/idle_ratio"
SYNC_TOTAL = "sync/total_s"
SYNC_PAUSED = "sync/paused_s"
SYNC_BYTES = "sync/bytes"
BUSY_S = "engine/busy_s"
UPTIME_S = "engine/uptime_s"
LAG_MEAN = "staleness/lag_mean"
LAG_FRAC = "staleness/lag_frac/trajectories/"  # + 0..max_staleness, over


@dataclass(frozen=True)
class Observations:
    mode: str
    config: dict[str, Any]  # the run's resolved config (`RunInfo.config`)
    # per learner step (metrics lines, in order)
    step: np.ndarray
    elapsed_s: np.ndarray  # pipeline clock when the line was logged
    step_s: np.ndarray
    step_tokens: np.ndarray  # prompt + response tokens of the trajectories the step consumed
    sync_s: np.ndarray
    paused_s: np.ndarray
    sync_bytes: np.ndarray
    idle_s: np.ndarray  # the learner's idle seconds so far
    engine_busy_s: np.ndarray  # mean over engines, since the engine started
    engine_uptime_s: np.ndarray
    train_spans: np.ndarray  # [n, 2] start, end of every learner step (pipeline clock)
    lag_hist: dict[str, float]  # the last line's lag shares of every trajectory trained so far
    lag_mean: float  # mean over the steps of the trained batch's mean lag
    # per finished trajectory
    turn_tokens: list[np.ndarray]  # tokens sampled in each assistant turn
    observation_tokens: np.ndarray  # per trajectory: tokens the environment added per reply
    prompt_tokens: np.ndarray
    interrupts: np.ndarray  # per trajectory: times a weight sync interrupted it
    generate_s: np.ndarray
    created_s: np.ndarray
    finished_s: np.ndarray

    @property
    def num_engines(self) -> int:
        return int(self.config["rollout"]["num_engines"])


def _mask_runs(mask: np.ndarray) -> np.ndarray:
    """Lengths of the runs of 1 in a response mask: the tokens of each assistant turn."""
    m = np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return edges[1::2] - edges[::2]


def _trajectories(run_dir: Path, clock0_unix: float) -> dict[str, Any]:
    frame = load_frame(RunDir(run_dir).buffer)
    done = frame[frame["is_latest"] & (frame["status"] == "finished")]
    turns = [_mask_runs(m) for m in done["response_mask"]]
    sampled = np.array([t.sum() for t in turns], dtype=np.float64)
    replies = np.array([max(len(t) - 1, 0) for t in turns], dtype=np.float64)
    obs = (done["num_response_tokens"].to_numpy() - sampled) / np.maximum(replies, 1)
    consumed = done["last_consume_step"].to_numpy()
    total = (done["num_prompt_tokens"] + done["num_response_tokens"]).to_numpy()
    return {
        "turn_tokens": turns,
        "observation_tokens": obs,
        "prompt_tokens": done["num_prompt_tokens"].to_numpy(dtype=np.float64),
        "generate_s": done["generate_s"].to_numpy(dtype=np.float64),
        "interrupts": done["num_interrupts"].to_numpy(dtype=np.int64),
        "created_s": done["created_at"].to_numpy(dtype=np.float64) - clock0_unix,
        "finished_s": done["finished_at"].to_numpy(dtype=np.float64) - clock0_unix,
        "tokens_by_step": {int(s): float(total[consumed == s].sum()) for s in np.unique(consumed) if s >= 0},
    }


def from_metrics(run_dir: str | Path) -> Observations:
    """A run's observations from its metrics lines, timeline and buffer (see the module docstring)."""
    run_dir = Path(run_dir)
    paths = RunDir.open(run_dir)
    config = paths.info().config
    lines = [r for r in paths.metric_records() if STEP_S in r]  # the step lines (not evaluations)
    if len(lines) < 3:
        raise ValueError(f"{run_dir}: {len(lines)} learner steps logged; calibration needs at least 3")
    clock0 = float(np.median([r["time"] - r[ELAPSED] for r in lines]))  # unix time of the pipeline's zero
    traj = _trajectories(run_dir, clock0)
    spans = [s for s in read_jsonl(paths.timeline) if s["kind"] == "train"] if paths.timeline.exists() else []

    def col(key: str) -> np.ndarray:
        return np.array([float(r.get(key) or 0.0) for r in lines])

    elapsed = col(ELAPSED)
    step = np.array([r["learner_step"] for r in lines])
    return Observations(
        mode=str(config["trainer"]["mode"]),
        config=config,
        step=step,
        elapsed_s=elapsed,
        step_s=col(STEP_S),
        step_tokens=np.array([traj["tokens_by_step"].get(int(s), np.nan) for s in step]),
        sync_s=col(SYNC_TOTAL),
        paused_s=col(SYNC_PAUSED),
        sync_bytes=col(SYNC_BYTES),
        idle_s=col(IDLE_RATIO) * elapsed,
        engine_busy_s=col(BUSY_S),
        engine_uptime_s=col(UPTIME_S),
        train_spans=np.array([[s["start"], s["end"]] for s in spans], dtype=np.float64).reshape(-1, 2),
        lag_hist={k: float(v) for k, v in lines[-1].items() if k.startswith(LAG_FRAC)},
        lag_mean=float(np.mean(col(LAG_MEAN))),
        **{k: v for k, v in traj.items() if k != "tokens_by_step"},
    )
