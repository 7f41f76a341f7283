"""MetricsLogger: JSONL records, spans and samples round-trip, resume appends, wandb is a fault
boundary (offline by default), and the histogram/summary helpers match hand-computed values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.observability.logs import format_duration
from streamrl.observability.metrics import (
    WANDB_ERRORS_KEY,
    MetricsLogger,
    SpanKind,
    WandbConfig,
    WandbMode,
    clean_metrics,
    eta_s,
    format_vitals,
    progress_line,
    resolve_wandb_mode,
    summarize,
)
from streamrl.rollout.types import FinishReason, Trajectory, TrajectoryStatus


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _traj(tid: str = "t0") -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        group_id="g0",
        sample_index=1,
        agent_name="tool_agent",
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 13],
        response_mask=[1, 1, 0, 1],
        behavior_logprobs=[-0.5, -0.25, 0.0, -1.0],
        policy_versions=[3, 4, -1, 4],
        reward=1.0,
        status=TrajectoryStatus.FINISHED,
        finish_reason=FinishReason.STOP,
        num_interrupts=1,
    )


def test_log_span_sample_round_trip(tmp_path):
    RunDir(tmp_path).write_info(RunInfo(run_name="r1", model_path="/m", mode="async", config={}, started_at=1000.0))
    with MetricsLogger(tmp_path, wandb_cfg=None, console=False) as ml:
        assert ml.started_at == 1000.0 and ml.run_name == "r1"
        ml.log(
            {
                "rollout/reward_mean": 0.5,
                "learner/loss": np.float32(1.25),
                "learner/grad_norm": float("nan"),
                "rollout/num_finished": 8,
                "sync/ok": True,
                "rollout/tool_error_rate": None,
                "buffer/occupancy": np.array([0.75]),
            },
            learner_step=3,
            policy_version=3,
        )
        ml.span(SpanKind.GENERATE, "engine-0", 1.0, 2.5)
        ml.span("train", "learner", 2.0, 2.0)
        with ml.timed("sync", "learner"):
            pass
        ml.sample(_traj(), learner_step=4)
    (rec,) = _lines(tmp_path / "metrics.jsonl")
    assert rec["learner_step"] == 3 and rec["policy_version"] == 3
    assert rec["rollout/reward_mean"] == 0.5 and rec["learner/loss"] == 1.25
    assert rec["learner/grad_norm"] is None  # NaN is not JSON: stored as null
    assert rec["rollout/num_finished"] == 8.0 and rec["sync/ok"] == 1.0
    assert rec["rollout/tool_error_rate"] is None and rec["buffer/occupancy"] == 0.75
    assert math.isclose(rec["elapsed_s"], rec["time"] - 1000.0, abs_tol=1e-3)
    spans = _lines(tmp_path / "timeline.jsonl")
    assert spans[:2] == [
        {"kind": "generate", "who": "engine-0", "start": 1.0, "end": 2.5},
        {"kind": "train", "who": "learner", "start": 2.0, "end": 2.0},
    ]
    assert spans[2]["kind"] == "sync" and spans[2]["end"] >= spans[2]["start"] > 0
    (row,) = _lines(tmp_path / "samples.jsonl")
    assert row.pop("learner_step") == 4
    back = Trajectory.from_dict(row)
    assert back == _traj() and back.status is TrajectoryStatus.FINISHED


def test_resume_appends_and_fences_a_torn_line(tmp_path):
    with MetricsLogger(tmp_path, wandb_cfg=None, console=False, started_at=5.0) as ml:
        ml.log({"learner/loss": 1.0}, learner_step=1, policy_version=1)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # SIGKILL mid-write leaves a torn line
        f.write('{"time": 12, "learner_st')
    with MetricsLogger(tmp_path, wandb_cfg=None, console=False, started_at=5.0) as ml:
        ml.log({"learner/loss": 0.5}, learner_step=1, policy_version=1)
        ml.log({"learner/loss": 0.25}, learner_step=2, policy_version=2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and lines[1] == '{"time": 12, "learner_st'
    good = [json.loads(line) for i, line in enumerate(lines) if i != 1]
    assert [r["learner/loss"] for r in good] == [1.0, 0.5, 0.25]


@pytest.mark.parametrize(
    "bad",
    [
        {"loss": 1.0},
        {"learner/": 1.0},
        {"learner_step": 1},
        {"learner/loss": "high"},
        {"learner/loss": [1, 2]},
        {"learner/loss": np.array([1.0, 2.0])},
    ],
)
def test_bad_metrics_raise(bad):
    with pytest.raises(ValueError):
        clean_metrics(bad)


def test_bad_spans_and_steps_raise(tmp_path):
    with MetricsLogger(tmp_path, wandb_cfg=None, console=False) as ml:
        with pytest.raises(ValueError, match="kind"):
            ml.span("nap", "engine-0", 0.0, 1.0)
        with pytest.raises(ValueError, match="end >= start"):
            ml.span("generate", "engine-0", 2.0, 1.0)
        with pytest.raises(ValueError, match="who"):
            ml.span("generate", "", 0.0, 1.0)
        with pytest.raises(ValueError, match=">= 0"):
            ml.log({"learner/loss": 1.0}, learner_step=-1, policy_version=0)
    assert (tmp_path / "timeline.jsonl").read_text() == ""


def test_wandb_mode_resolution():
    assert resolve_wandb_mode(None, {}) is WandbMode.DISABLED
    assert resolve_wandb_mode(WandbConfig(enabled=False, mode="online"), {}) is WandbMode.DISABLED
    assert resolve_wandb_mode(WandbConfig(), {}) is WandbMode.OFFLINE
    assert resolve_wandb_mode(WandbConfig(), {"WANDB_MODE": "online"}) is WandbMode.ONLINE
    assert resolve_wandb_mode(WandbConfig(), {"WANDB_MODE": "dryrun"}) is WandbMode.OFFLINE
    assert resolve_wandb_mode(WandbConfig(), {"WANDB_MODE": "bogus"}) is WandbMode.OFFLINE
    assert resolve_wandb_mode(WandbConfig(mode="online"), {"WANDB_MODE": "offline"}) is WandbMode.ONLINE
    assert resolve_wandb_mode(WandbConfig(mode="offline"), {"WANDB_MODE": "online"}) is WandbMode.OFFLINE
    with pytest.raises(ValueError):
        WandbConfig(mode="cloud")
    with pytest.raises(ValueError):
        WandbConfig(projekt="typo")


@pytest.mark.timeout(60)
def test_wandb_offline_run_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (tmp_path / "wb").mkdir()
    cfg = WandbConfig(project="streamrl-test", tags=["unit"])
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, wandb_cfg=cfg, console=False, config={"lr": 1e-5}) as ml:
        assert ml._wandb_run is not None
        ml.log({"rollout/reward_mean": 0.1}, learner_step=1, policy_version=1)
    run_id = (run_dir / "wandb_run_id").read_text()
    offline = list((tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline and list(offline[0].glob("*.wandb"))
    with MetricsLogger(run_dir, wandb_cfg=cfg, console=False) as ml:  # a resumed run keeps the wandb id
        ml.log({"rollout/reward_mean": 0.2}, learner_step=2, policy_version=2)
    assert (run_dir / "wandb_run_id").read_text() == run_id
    assert ml.num_wandb_errors == 0


def test_wandb_failure_is_counted_not_fatal(tmp_path, monkeypatch):
    import wandb

    def broken_init(**kwargs):
        raise RuntimeError("no api key")

    monkeypatch.setattr(wandb, "init", broken_init)
    with MetricsLogger(tmp_path, wandb_cfg=WandbConfig(mode="online"), console=False) as ml:
        ml.log({"learner/loss": 1.0}, learner_step=1, policy_version=1)
    (rec,) = _lines(tmp_path / "metrics.jsonl")
    assert ml.num_wandb_errors == 1 and rec[WANDB_ERRORS_KEY] == 1


def test_wandb_log_failure_is_counted(tmp_path):
    class FlakyRun:
        def log(self, data):
            raise OSError("disk full")

        def finish(self):
            pass

    ml = MetricsLogger(tmp_path, wandb_cfg=None, console=False)
    ml._wandb_run = FlakyRun()
    ml.log({"learner/loss": 1.0}, learner_step=1, policy_version=1)
    ml.log({"learner/loss": 1.0}, learner_step=2, policy_version=2)
    ml.close()
    assert ml.num_wandb_errors == 2
    assert [r.get(WANDB_ERRORS_KEY) for r in _lines(tmp_path / "metrics.jsonl")] == [None, 1]


def test_console_progress_line(tmp_path, caplog):
    """Off a terminal (CI, pipes) every step prints one concise line; the ETA shows from the second step."""
    with caplog.at_level("INFO", logger="streamrl.observability.metrics"):
        with MetricsLogger(tmp_path, wandb_cfg=None, console=True, total_steps=10) as ml:
            ml.log(
                {
                    "rollout/reward_mean": 0.25,
                    "staleness/lag_mean": 1.5,
                    "engine/busy_fraction/engine-0": 0.9,
                    "engine/busy_fraction/engine-1": 1.0,
                    "rollout/tokens_per_s": 1234.0,
                },
                learner_step=2,
                policy_version=2,
            )
            ml.log({"learner/loss": 1.0}, learner_step=3, policy_version=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "streamrl.observability.metrics"]
    assert lines[0] == "step 2/10 · reward 0.250 · lag 1.50 · busy 95% · 1.2k tok/s · v2 · 0:00 elapsed"
    assert lines[1].startswith(
        "step 3/10 · reward 0.250 · lag 1.50 · busy 95% · 1.2k tok/s · v3 · 0:00 elapsed · eta 0:0"
    )


def test_eta_and_durations():
    assert eta_s(None, 3, 10.0, 10) is None
    assert eta_s((2, 0.0), 2, 10.0, 10) is None  # one step seen: its time includes the start-up
    assert eta_s((2, 0.0), 4, 10.0, 10) == 30.0  # 5 s per step, 6 to go
    assert eta_s((2, 0.0), 4, 10.0, None) is None
    assert format_duration(65) == "1:05" and format_duration(3725) == "1:02:05" and format_duration(-1) == "0:00"
    line = progress_line({"learner_step": 4, "elapsed_s": 70.0}, total_steps=None, eta=None)
    assert line == "step 4 · 1:10 elapsed"


def test_format_vitals_keeps_what_is_known():
    assert format_vitals({}) == ""
    assert format_vitals({"engine/busy_fraction": 0.5, "rollout/tokens_per_s": 12.0}) == "busy 50% · 12 tok/s"


def test_summarize_matches_hand_values():
    out = summarize([1, 2, 3, 4], prefix="staleness/lag_")
    assert out["staleness/lag_mean"] == 2.5 and out["staleness/lag_max"] == 4 and out["staleness/lag_min"] == 1
    assert out["staleness/lag_p50"] == 2.5 and math.isclose(out["staleness/lag_std"], math.sqrt(1.25))
    assert math.isclose(out["staleness/lag_p90"], 3.7)
    assert summarize([]) == {}
    with pytest.raises(ValueError):
        summarize([1.0], quantiles=[1.5])
