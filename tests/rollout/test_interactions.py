"""Interactions: the math-feedback episode logic, and loading verl's interaction config."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.rollout.interactions import BaseInteraction, MathFeedbackInteraction, load_interaction_config
from streamrl.rollout.interactions.base import num_replies
from streamrl.workloads.interactions.latency_env import LatencyEnvironment

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "interactions" / "math_feedback.yaml"


def _chat(answer_text: str) -> list[dict]:
    return [
        {"role": "user", "content": "What is 37 + 5 * 12?"},
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "97"},
        {"role": "assistant", "content": answer_text},
    ]


async def test_correct_answer_terminates_with_score_one():
    interaction = MathFeedbackInteraction({"name": "math", "max_attempts": 3})
    iid = await interaction.start_interaction("traj-1", ground_truth="97")
    assert iid == "traj-1"
    done, text, score, extra = await interaction.generate_response(iid, _chat("So it is \\boxed{97}."))
    assert (done, text, score) == (True, "Your answer is correct.", 1.0)
    assert extra == {"answer": "97", "num_attempts": 1}
    assert await interaction.calculate_score(iid) == 1.0
    await interaction.finalize_interaction(iid)
    with pytest.raises(ValueError, match="no instance"):
        await interaction.calculate_score(iid)


async def test_wrong_answers_get_feedback_until_max_attempts():
    interaction = MathFeedbackInteraction({"max_attempts": 2})
    iid = await interaction.start_interaction(ground_truth=97)
    done, text, score, _ = await interaction.generate_response(iid, _chat("\\boxed{96}"))
    assert not done and score == 0.0
    assert text.startswith("Your answer 96 is incorrect. Please re-check")
    done, text, score, extra = await interaction.generate_response(iid, _chat("I think it is 95"))
    assert done and score == 0.0 and text == "Your answer 95 is incorrect." and extra["num_attempts"] == 2
    assert await interaction.calculate_score(iid) == 0.0


async def test_retry_then_correct_scores_one():
    interaction = MathFeedbackInteraction({"max_attempts": 3})
    iid = await interaction.start_interaction(ground_truth="1,234")
    assert (await interaction.generate_response(iid, _chat("\\boxed{1233}")))[0] is False
    done, _, score, _ = await interaction.generate_response(iid, _chat("\\boxed{1234}"))
    assert done and score == 1.0 and await interaction.calculate_score(iid) == 1.0


async def test_attempts_survive_a_process_change():
    first = MathFeedbackInteraction({"max_attempts": 2})
    iid = await first.start_interaction("traj-1", ground_truth="97")
    chat = _chat("\\boxed{96}")
    done, feedback, _, _ = await first.generate_response(iid, chat)
    assert not done
    chat += [{"role": "user", "content": feedback}]
    # The trajectory resumes in another process: a fresh interaction object, restored from the chat.
    other = MathFeedbackInteraction({"max_attempts": 2})
    assert await other.restore(iid, chat, ground_truth="97") == iid
    chat += [{"role": "assistant", "content": "\\boxed{95}"}]
    done, text, score, extra = await other.generate_response(iid, chat)
    assert (done, text, score, extra["num_attempts"]) == (True, "Your answer 95 is incorrect.", 0.0, 2)


async def test_latency_env_turns_survive_a_process_change():
    config = {"latency_s": 0.0, "num_turns": 2}
    env = LatencyEnvironment(config)
    chat = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "a"}]
    done, reply, _, _ = await env.generate_response(await env.start_interaction("t"), chat)
    assert not done
    chat += [{"role": "user", "content": reply}, {"role": "assistant", "content": "b"}]
    other = LatencyEnvironment(config)
    await other.restore("t", chat[:-1])
    assert (await other.generate_response("t", chat))[0] is True


def test_num_replies_counts_user_messages_after_the_first_assistant_turn():
    assert num_replies([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]) == 0
    assert num_replies(_chat("x")) == 0  # tool results are not replies
    assert num_replies([*_chat("x"), {"role": "user", "content": "wrong"}, {"role": "assistant", "content": "y"}]) == 1


async def test_require_boxed_asks_for_a_boxed_answer():
    interaction = MathFeedbackInteraction({"max_attempts": 2, "require_boxed": True})
    iid = await interaction.start_interaction(ground_truth="97")
    done, text, score, extra = await interaction.generate_response(iid, _chat("The answer is 97."))
    assert not done and score == 0.0 and extra["answer"] is None
    assert "\\boxed{NUMBER}" in text


async def test_start_without_ground_truth_and_bad_config_raise():
    with pytest.raises(ValueError, match="ground_truth"):
        await MathFeedbackInteraction({}).start_interaction()
    with pytest.raises(ValueError, match="max_attempts"):
        MathFeedbackInteraction({"max_attempts": 0})


def test_load_verl_interaction_config():
    interactions = load_interaction_config(CONFIG)
    assert list(interactions) == ["math_feedback"]
    interaction = interactions["math_feedback"]
    assert isinstance(interaction, MathFeedbackInteraction) and interaction.name == "math_feedback"
    assert interaction.config.max_attempts == 3 and interaction.config.require_boxed is True


def test_load_builtin_by_name_and_custom_class():
    interactions = load_interaction_config(
        {
            "interactions": [
                {"name": "math_feedback", "config": {"max_attempts": 5}},
                {"name": "echo", "class_name": f"{__name__}:EchoInteraction", "config": {"greeting": "hi"}},
            ]
        }
    )
    assert interactions["math_feedback"].config.max_attempts == 5
    assert interactions["echo"].name == "echo" and interactions["echo"].config == {"greeting": "hi"}


class EchoInteraction(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return True, messages[-1]["content"], 0.0, {}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"tools": []}, "`interaction` list"),
        ({"interaction": {"name": "x"}}, "must be a list"),
        ({"interaction": [{"name": "nope"}]}, "unknown built-in interaction 'nope'"),
        ({"interaction": [{"name": "a", "class_name": "streamrl.rollout.types:ToolCall"}]}, "not a subclass"),
        ({"interaction": [{"name": "math_feedback", "config": {"max_attempts": -1}}]}, "max_attempts"),
        ({"interaction": [{"name": "math_feedback"}, {"name": "math_feedback"}]}, "duplicate"),
        ({"interaction": [{"name": "math_feedback", "config": {"bogus": 1}}]}, "bogus"),
    ],
)
def test_bad_interaction_configs(data, needle):
    with pytest.raises(ValueError) as info:
        load_interaction_config(data)
    assert needle in str(info.value), str(info.value)
