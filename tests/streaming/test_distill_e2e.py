"""End to end: `streamrl train` on the tiny config with a distillation teacher (`[distill]`, the tiny
model itself on its own engine actor), 2 steps. Every consumed row carries the teacher's log-prob of
every sampled token; rows sampled by the starting weights (policy version 0) were scored by a teacher
with those very weights, so each score equals the behaviour log-prob; every `distill/*` key the
learner and the workers write is logged and declared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamrl.core import catalogue

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.timeout(900)
def test_train_with_a_teacher_scores_every_sampled_token(tmp_path, tiny_model_path):
    from streamrl.buffer.cli import load_frame

    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("RAY_ADDRESS", None)
    args = [
        "--config",
        "configs/tiny.toml",
        f"trainer.run_root={tmp_path}",
        "trainer.run_name=d",
        "trainer.total_steps=2",
        "distill.teacher=tiny",
        "distill.mode=mixed",
        "rollout.agent.response_length=64",
        "rollout.agent.max_tokens_per_turn=32",
        "buffer.batch_size=4",
        "buffer.group_size=2",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl.streaming.cli", "train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run_dir = tmp_path / "d"

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [m for m in lines if "learner/loss" in m]
    assert len(trained) == 2
    for m in trained:
        assert m["distill/coverage"] == 1.0 and 0.0 <= m["distill/teacher_share"] <= 1.0
    assert sum(m.get("distill/num_scored", 0.0) for m in lines) >= 8
    assert any("distill/teacher_latency_mean_s" in m for m in lines)
    assert not catalogue.undeclared({k for m in lines for k in m})

    frame = load_frame(run_dir / "buffer")
    latest = frame[frame["is_latest"]]
    consumed = latest[latest["num_consumed"] > 0]
    assert len(consumed) == 2 * 4
    for _, row in consumed.iterrows():
        mask = np.asarray(row["response_mask"])
        teacher = row["teacher_logprobs"]
        assert teacher is not None and len(teacher) == len(mask), row["trajectory_id"]
        teacher, behavior = np.asarray(teacher), np.asarray(row["behavior_logprobs"])
        assert np.isfinite(teacher[mask == 1]).all() and (teacher[mask == 0] == 0).all()
        at_v0 = (mask == 1) & (np.asarray(row["policy_versions"]) == 0)
        assert np.abs(teacher[at_v0] - behavior[at_v0]).max(initial=0.0) < 1e-4, row["trajectory_id"]
    unscored = latest[latest["status"] != "finished"]
    assert unscored["teacher_logprobs"].isna().all()  # partial and failed rows are not scored
