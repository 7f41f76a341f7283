"""Held-out evaluation (streaming/heldout.py): which prompts, how they are sampled, what is logged,
when it runs and how it pins one policy version. The real run (engines, the schedule across a killed
and resumed run) is checked in test_e2e.py, and the learning it measures in test_learning.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.data import load_records
from streamrl.rollout.data.loaders import messages_hash
from streamrl.rollout.types import PromptRecord, Trajectory, TrajectoryStatus
from streamrl.streaming.config import load_config
from streamrl.streaming.heldout import (
    EVAL_GROUP_PREFIX,
    Evaluator,
    check_pinned,
    eval_config,
    eval_file,
    first_last_comparison,
    heldout_metrics,
    heldout_records,
    read_evaluation,
    run_heldout,
    summary_line,
    write_rows,
)
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)


def _cfg(*overrides: str):
    return load_config(REPO / "configs/tiny.toml", list(overrides))


def _rows(path, answers: list[str], tag: str) -> str:
    with open(path, "w") as f:
        for i, answer in enumerate(answers):
            f.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": f"{tag} question {i}?"}],
                        "reward_model": {"ground_truth": answer},
                    }
                )
                + "\n"
            )
    return str(path)


def test_a_generated_source_draws_held_out_prompts_apart_from_the_training_stream():
    cfg = _cfg("eval.num_prompts=16", "data.difficulty=easy", "data.num_prompts=64")
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
    cfg = _cfg(f"data.source={train}", f"eval.source={held}", "eval.num_prompts=3")
    records = heldout_records(cfg, load_records(train, 2, 0))
    assert [r.ground_truth for r in records] == ["3", "4", "5"]
    with pytest.raises(ValueError, match="only 2 held-out prompts are not also training prompts"):
        heldout_records(cfg, load_records(held, 1, 0)[:1])  # one of the three is a training prompt


def test_a_dataset_source_needs_an_eval_source(tmp_path):
    train = _rows(tmp_path / "train.jsonl", ["1"], "train")
    with pytest.raises(ValueError, match="set eval.source"):
        _cfg(f"data.source={train}", "eval.num_prompts=2")
    assert _cfg(f"data.source={train}").eval.num_prompts == 0  # off by default


def test_the_old_data_eval_keys_name_their_new_place():
    with pytest.raises(ValueError, match=r"data.eval_num_prompts -> eval.num_prompts"):
        _cfg("data.eval_num_prompts=4")
    with pytest.raises(ValueError, match=r"data.eval_temperature -> eval.temperature"):
        _cfg("data.eval_temperature=0.5")


def test_eval_config_samples_at_the_eval_temperature_and_changes_nothing_else():
    cfg = _cfg("eval.temperature=0.3")
    evaluated = eval_config(cfg)
    assert evaluated.rollout.agent.sampling.temperature == 0.3
    assert cfg.rollout.agent.sampling.temperature == 1.0  # the run's own config is untouched
    assert evaluated.rollout.agent.model_copy(update={"sampling": cfg.rollout.agent.sampling}) == cfg.rollout.agent


def _traj(status: TrajectoryStatus, reward: float, n: int, group_id: str = "g", version: int = 0) -> Trajectory:
    return Trajectory(
        trajectory_id="t",
        group_id=group_id,
        sample_index=0,
        agent_name="tool_agent",
        prompt_ids=[1],
        response_ids=[5] * n,
        response_mask=[1] * n,
        behavior_logprobs=[-0.1] * n,
        policy_versions=[version] * n,
        reward=reward,
        status=status,
    )


def test_a_failed_or_missing_sample_scores_zero():
    records = [PromptRecord(group_id=f"eval/p{i}", messages=[{"role": "user", "content": str(i)}]) for i in range(4)]
    trajs = [
        _traj(TrajectoryStatus.FINISHED, 1.0, 4, "eval/p0@e0"),
        _traj(TrajectoryStatus.FINISHED, 0.0, 2, "eval/p1@e0"),
        _traj(TrajectoryStatus.FAILED, 1.0, 0, "eval/p2@e0"),
    ]  # p3 never came back
    summary, metrics = heldout_metrics(trajs, records, k=1, threshold=1.0, seconds=2.0)
    assert summary.avg_reward == 0.25 and summary.pass_at_1 == 0.25
    assert metrics["eval/num_failed"] == 2.0 and metrics["eval/response_length_mean"] == 3.0


async def test_every_held_out_prompt_runs_once_through_the_agent_loop_and_is_scored(
    tmp_path, tiny_tokenizer, tiny_model_path
):
    """On a scripted engine that always answers \\boxed{42}: exactly the prompts whose ground truth is
    42 score, each prompt ran once, and no trajectory carries a training group id."""
    answers = ["42", "7", "42", "9", "42"]
    held = _rows(tmp_path / "held.jsonl", answers, "held")
    cfg = _cfg(f"eval.source={held}", "eval.num_prompts=5")
    records = heldout_records(cfg, [])
    engine = FakeEngine(script=[tiny_tokenizer.encode("The answer is \\boxed{42}.")])
    trajs = await run_heldout(cfg, str(tiny_model_path), [engine], records, timeout_s=60)
    assert sorted(t.group_id for t in trajs) == sorted(f"{r.group_id}@e0" for r in records)
    assert len(engine.requests_seen) == 5
    by_group = {t.group_id: t.reward for t in trajs}
    assert [by_group[f"{r.group_id}@e0"] for r in records] == [1.0 if a == "42" else 0.0 for a in answers]
    assert heldout_metrics(trajs, records, k=1, threshold=1.0, seconds=1.0)[0].avg_reward == pytest.approx(0.6)


# ---- the schedule and version pinning (Evaluator) ----------------------------------------------------


def _evaluator(tmp_path, *overrides: str) -> Evaluator:
    cfg = _cfg("eval.num_prompts=4", "trainer.total_steps=12", *overrides)
    return Evaluator.open(cfg, tmp_path, load_records(cfg.data.source, cfg.data.num_prompts, cfg.data.seed))


def test_the_schedule_is_step_zero_each_multiple_once_and_the_last_step(tmp_path):
    ev = _evaluator(tmp_path, "eval.every_steps=5")
    assert ev.due(0) and not ev.due(3)
    ev.done_steps = {0}
    assert ev.due(5) and ev.due(6)  # sync_every=2 never serves step 5: the first served step past it counts
    ev.done_steps = {0, 6}
    assert not ev.due(8) and not ev.due(6) and ev.due(10) and ev.due(12)
    assert ev.due(7, final=True)  # the run ends on these weights (prompts ran out early)
    assert not _evaluator(tmp_path, "eval.every_steps=0").due(5)  # only the start and the end
    assert _evaluator(tmp_path, "eval.every_steps=0").due(12)


def test_a_resumed_run_reads_its_evaluations_and_repeats_none(tmp_path):
    traj = _traj(TrajectoryStatus.FINISHED, 1.0, 3, "eval/p@e0", version=7)
    write_rows(eval_file(tmp_path, 5, 7), [traj], served_step=5, policy_version=7, started_elapsed_s=1.0, seconds=2.0)
    ev = _evaluator(tmp_path, "eval.every_steps=5")
    assert ev.done_steps == {5} and not ev.due(5) and not ev.due(9) and ev.due(10)
    assert read_evaluation(eval_file(tmp_path, 5, 7)) == {"eval/p": 1.0}


class _State:
    def __init__(self) -> None:
        self.served_step, self.policy_version, self.learner_step = 0, 0, 0


class _System:
    """What `driver.publish` and `Evaluator.maybe_start` use of a Pipeline."""

    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator, self.state, self.published_while_evaluating = evaluator, _State(), []
        self.cfg = evaluator.cfg

    async def publish_weights(self) -> dict[str, float]:
        self.published_while_evaluating.append(self.evaluator._task is not None and not self.evaluator._task.done())
        self.state.served_step += 1
        self.state.policy_version += 1
        self.state.learner_step += 1
        return {}


async def test_a_publish_waits_for_the_running_evaluation_so_its_version_stays_pinned(tmp_path):
    from streamrl.streaming.driver import publish

    ev = _evaluator(tmp_path, "eval.every_steps=1")
    served: list[tuple[int, int]] = []
    gate = asyncio.Event()

    async def slow_evaluate(pipeline, served_step, policy_version):
        await gate.wait()  # still generating when the learner wants to publish
        served.append((served_step, pipeline.state.policy_version))
        return {}

    ev._evaluate = slow_evaluate
    pipeline = _System(ev)
    assert ev.maybe_start(pipeline)
    publishing = asyncio.create_task(publish(pipeline))
    await asyncio.sleep(0.05)
    assert not publishing.done()  # held
    gate.set()
    metrics = await asyncio.wait_for(publishing, 5)
    assert served[0] == (0, 0)  # evaluated with the version it started on, to the end
    assert pipeline.published_while_evaluating == [False] and metrics["eval/sync_held_s"] > 0
    assert ev.done_steps == {0, 1}  # the new weights are due at every_steps=1: their evaluation started
    await ev.drain()
    assert served == [(0, 0), (1, 1)]


async def test_an_evaluation_past_max_hold_is_abandoned_not_mixed(tmp_path):
    ev = _evaluator(tmp_path, "eval.max_hold_s=0.1")
    cancelled = asyncio.Event()

    async def hung(pipeline, served_step, policy_version):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    ev._evaluate = hung
    assert ev.maybe_start(_System(ev))
    held = await asyncio.wait_for(ev.hold(), 5)
    assert cancelled.is_set() and ev.num_abandoned == 1 and held >= 0.1
    assert not ev.due(0)  # not retried on other weights


async def test_a_failed_evaluation_surfaces_at_the_next_hold(tmp_path):
    ev = _evaluator(tmp_path)

    async def broken(pipeline, served_step, policy_version):
        raise RuntimeError("engine gone")

    ev._evaluate = broken
    ev.maybe_start(_System(ev))
    with pytest.raises(RuntimeError, match="engine gone"):
        await ev.hold()


def test_tokens_of_another_version_in_an_evaluation_are_a_bug():
    check_pinned([_traj(TrajectoryStatus.FINISHED, 1.0, 3, version=4)], 4)
    mixed = _traj(TrajectoryStatus.FINISHED, 1.0, 3, version=4)
    mixed.policy_versions[-1] = 5
    with pytest.raises(AssertionError, match="other versions"):
        check_pinned([mixed], 4)


def test_the_summary_line_compares_the_first_and_last_evaluation(tmp_path):
    for step, version, rewards in [(0, 0, [0.0, 0.0, 1.0]), (3, 3, [1.0, 1.0, 1.0])]:
        trajs = [_traj(TrajectoryStatus.FINISHED, r, 2, f"eval/p{i}@e0", version) for i, r in enumerate(rewards)]
        write_rows(
            eval_file(tmp_path, step, version),
            trajs,
            served_step=step,
            policy_version=version,
            started_elapsed_s=0.0,
            seconds=1.0,
        )
    first, last, result = first_last_comparison(tmp_path)
    assert (first, last, result.num_up, result.num_down, result.test) == (0, 3, 2, 0, "mcnemar-exact")
    assert result.p_value == pytest.approx(0.5)  # 2 of 2 discordant pairs up: 2 x 1/4
    assert "step 0 -> step 3" in summary_line(tmp_path)


async def test_the_last_weights_are_evaluated_after_the_workers_park_not_at_the_publish(tmp_path):
    """The run's last publish starts no evaluation: `_train` starts it once the workers are parked, so
    it does not share the engines with rollouts nobody will train on."""
    from streamrl.streaming.driver import publish

    ev = Evaluator.open(_cfg("eval.num_prompts=4", "trainer.total_steps=1"), tmp_path, [])
    pipeline = _System(ev)
    await publish(pipeline)
    assert pipeline.state.learner_step == 1 and ev._task is None and ev.due(1, final=True)
