"""Held-out evaluation (streaming/heldout.py): which prompts, how they are sampled, what is logged.
The real run (engines, start and end of a killed and resumed run) is checked in test_e2e.py."""

from __future__ import annotations

import json

import pytest

from streamrl.rollout.data import messages_hash
from streamrl.rollout.engine.fake import FakeEngine
from streamrl.rollout.types import Trajectory, TrajectoryStatus
from streamrl.streaming.config import load_config
from streamrl.streaming.heldout import (
    EVAL_GROUP_PREFIX,
    eval_config,
    heldout_metrics,
    heldout_records,
    run_heldout,
)
from streamrl.streaming.prompts import load_records
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)


def _cfg(*overrides: str):
    return load_config(REPO / "configs/tiny.toml", list(overrides))


def _rows(path, answers: list[str], tag: str) -> str:
    with open(path, "w") as f:
        for i, answer in enumerate(answers):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{tag} question {i}?"}],
                                "reward_model": {"ground_truth": answer}}) + "\n")
    return str(path)


def test_a_generated_source_draws_held_out_prompts_apart_from_the_training_stream():
    cfg = _cfg("data.eval_num_prompts=16", "data.difficulty=easy", "data.num_prompts=64")
    training = load_records(cfg.data.source, cfg.data.num_prompts, cfg.data.seed, cfg.data.difficulty)
    held = heldout_records(cfg, training)
    assert len(held) == 16 and all(r.group_id.startswith(EVAL_GROUP_PREFIX) for r in held)
    assert not {messages_hash(r.messages) for r in held} & {messages_hash(r.messages) for r in training}
    assert [r.messages for r in heldout_records(cfg, training)] == [r.messages for r in held]  # deterministic
    # a prompt the training stream holds is never evaluated, even if the held-out draw produced it
    assert heldout_records(cfg, training + held)[0].messages != held[0].messages


def test_eval_source_is_read_and_overlap_with_training_is_refused(tmp_path):
    train = _rows(tmp_path / "train.jsonl", ["1", "2"], "train")
    held = _rows(tmp_path / "held.jsonl", ["3", "4", "5"], "held")
    cfg = _cfg(f"data.source={train}", f"data.eval_source={held}", "data.eval_num_prompts=3")
    records = heldout_records(cfg, load_records(train, 2, 0))
    assert [r.ground_truth for r in records] == ["3", "4", "5"]
    with pytest.raises(ValueError, match="only 2 held-out prompts are not also training prompts"):
        heldout_records(cfg, load_records(held, 1, 0)[:1])  # one of the three is a training prompt


def test_a_dataset_source_needs_an_eval_source(tmp_path):
    train = _rows(tmp_path / "train.jsonl", ["1"], "train")
    with pytest.raises(ValueError, match="set data.eval_source"):
        _cfg(f"data.source={train}", "data.eval_num_prompts=2")
    assert _cfg(f"data.source={train}").data.eval_num_prompts == 0  # off by default


def test_eval_config_samples_at_the_eval_temperature_and_changes_nothing_else():
    cfg = _cfg("data.eval_temperature=0.3")
    evaluated = eval_config(cfg)
    assert evaluated.rollout.agent.sampling.temperature == 0.3
    assert cfg.rollout.agent.sampling.temperature == 1.0  # the run's own config is untouched
    assert evaluated.rollout.agent.model_copy(update={"sampling": cfg.rollout.agent.sampling}) == cfg.rollout.agent


def _traj(status: TrajectoryStatus, reward: float, n: int) -> Trajectory:
    return Trajectory(trajectory_id="t", group_id="g", sample_index=0, agent_name="tool_agent", prompt_ids=[1], response_ids=[5] * n, response_mask=[1] * n,
                      behavior_logprobs=[-0.1] * n, policy_versions=[0] * n, reward=reward, status=status)


def test_a_failed_trajectory_scores_zero_over_every_prompt():
    trajs = [_traj(TrajectoryStatus.FINISHED, 1.0, 4), _traj(TrajectoryStatus.FINISHED, 0.0, 2),
             _traj(TrajectoryStatus.FAILED, 0.0, 0)]
    metrics = heldout_metrics(trajs, num_prompts=4, seconds=2.0)  # one prompt never came back either
    assert metrics == {"eval/reward_mean": 0.25, "eval/num_prompts": 4.0, "eval/num_failed": 2.0,
                       "eval/response_length_mean": 3.0, "eval/seconds": 2.0}


async def test_every_held_out_prompt_runs_once_through_the_agent_loop_and_is_scored(tmp_path, tiny_tokenizer, tiny_model_path):
    """On a scripted engine that always answers \\boxed{42}: exactly the prompts whose ground truth is
    42 score, each prompt ran once, and no trajectory carries a training group id."""
    answers = ["42", "7", "42", "9", "42"]
    held = _rows(tmp_path / "held.jsonl", answers, "held")
    cfg = _cfg(f"data.eval_source={held}", "data.eval_num_prompts=5")
    records = heldout_records(cfg, [])
    engine = FakeEngine(script=[tiny_tokenizer.encode("The answer is \\boxed{42}.")])
    trajs = await run_heldout(cfg, str(tiny_model_path), [engine], records, timeout_s=60)
    assert sorted(t.group_id for t in trajs) == sorted(f"{r.group_id}@e0" for r in records)
    assert len(engine.requests_seen) == 5
    by_group = {t.group_id: t.reward for t in trajs}
    assert [by_group[f"{r.group_id}@e0"] for r in records] == [1.0 if a == "42" else 0.0 for a in answers]
    assert heldout_metrics(trajs, num_prompts=5, seconds=1.0)["eval/reward_mean"] == pytest.approx(0.6)
