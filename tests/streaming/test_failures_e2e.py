"""The real `streamrl train` on the tiny config with a reward function that raises on every
trajectory (`math:sqrt` given a `RewardInput`): the run stops with the reason and a non-zero exit
status, having trained nothing, instead of walking through every prompt and exiting 0. About a
minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.mark.timeout(600)
def test_a_reward_that_always_raises_stops_the_run_with_the_reason(tmp_path, tiny_model_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("RAY_ADDRESS", None)
    args = [
        "--config",
        "configs/tiny.toml",
        f"trainer.run_root={tmp_path}",
        "trainer.run_name=r",
        "rollout.agent.reward_fn=math:sqrt",
        "trainer.failed_window=16",
        "trainer.stall_timeout_s=300",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl.streaming.cli", "train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "trainer.max_failed_fraction" in out and "TypeError: must be real number" in out, out[-4000:]
    metrics = tmp_path / "r" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    assert not [m for m in lines if "learner/loss" in m]  # nothing was trained
    state = json.loads((tmp_path / "r" / "driver_state.json").read_text())
    assert state["learner_step"] == 0 and state["cursor"] < 64  # stopped before the prompts ran out
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())  # the prompts' fingerprint, checked on resume
    assert len(info["prompts_sha256"]) == 64 and info["num_prompts"] == 64
