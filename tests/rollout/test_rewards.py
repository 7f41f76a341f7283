"""Reward functions: answer extraction, numeric comparison, shaping, registry resolution."""

from __future__ import annotations

import pytest

from streamrl.rollout.rewards import (
    RewardInput,
    answers_match,
    extract_answer,
    get_reward_fn,
    last_boxed,
    math_answer,
    math_answer_with_tool_bonus,
    parse_number,
    register_reward,
    registered_rewards,
    with_length_penalty,
)


def _inp(
    final: str, truth: str | None = "97", *, calls: int = 0, errors: int = 0, response: str | None = None
) -> RewardInput:
    return RewardInput(
        response_text=final if response is None else response,
        final_answer_text=final,
        ground_truth=truth,
        num_turns=2,
        num_tool_calls=calls,
        num_tool_errors=errors,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{97}.", "97"),
        ("\\boxed{1} then \\boxed{ 2 }", "2"),
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("\\fbox{5}", "5"),
        ("the total is 1,234 apples.", "1,234"),
        ("values 3, 4 and -5.5", "-5.5"),
        ("no numbers here", None),
        ("\\boxed{} but 7", "7"),
        ("unbalanced \\boxed{12 and 13", "13"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_handles_nested_braces():
    assert last_boxed("a \\boxed{\\text{x}{y}} b") == "\\text{x}{y}"
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,234", 1234.0),
        ("3/4", 0.75),
        ("\\frac{1}{8}", 0.125),
        ("\\dfrac{3}{2}", 1.5),
        ("$12.50", 12.5),
        ("42 apples", 42.0),
        ("\\text{42}", 42.0),
        ("-7.", -7.0),
        ("50\\%", 50.0),
        ("1e3", 1000.0),
        ("apples", None),
        ("1/0", None),
        ("inf", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_answers_match_numeric_tolerance_and_strings():
    assert answers_match("97.0", "97") and answers_match("0.3333333", "1/3", rel_tol=1e-6)
    assert not answers_match("98", "97") and not answers_match(None, "97") and not answers_match("97", None)
    assert answers_match("\\text{Paris}", "paris") and not answers_match("Rome", "Paris")


def test_math_answer():
    assert math_answer(_inp("It is \\boxed{97}")) == 1.0
    assert math_answer(_inp("It is \\boxed{96}, not 97")) == 0.0  # boxed wins over the last number
    assert math_answer(_inp("The answer is 97.")) == 1.0
    assert math_answer(_inp("\\boxed{97}", truth=None)) == 0.0
    # An empty last message falls back to the whole assistant text.
    assert math_answer(_inp("", response="... \\boxed{97}")) == 1.0


def test_math_answer_with_tool_bonus_shaping():
    assert math_answer_with_tool_bonus(_inp("\\boxed{97}")) == 1.0
    assert math_answer_with_tool_bonus(_inp("\\boxed{97}", calls=1)) == pytest.approx(1.1)
    assert math_answer_with_tool_bonus(_inp("\\boxed{97}", calls=2, errors=1)) == pytest.approx(1.05)
    assert math_answer_with_tool_bonus(_inp("\\boxed{1}", calls=1, errors=1)) == pytest.approx(-0.05)
    assert math_answer_with_tool_bonus(_inp("\\boxed{1}", calls=10, errors=10)) == pytest.approx(-0.2)  # capped
    # A correct answer always beats any tool behaviour on a wrong one.
    assert math_answer_with_tool_bonus(_inp("\\boxed{97}", calls=10, errors=10)) > math_answer_with_tool_bonus(
        _inp("\\boxed{1}", calls=1)
    )


def test_length_penalty_wrapper():
    fn = with_length_penalty(math_answer, max_chars=10, coef=0.5)
    assert fn(_inp("\\boxed{97}")) == 1.0  # exactly 10 characters
    assert fn(_inp("\\boxed{97}", response="x" * 15)) == pytest.approx(0.75)
    assert fn(_inp("\\boxed{97}", response="x" * 1000)) == pytest.approx(0.5)  # capped at coef
    assert get_reward_fn("math_answer_length_penalty")(_inp("\\boxed{97}", response="y" * 6000)) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        with_length_penalty(math_answer, max_chars=0)


def custom_reward(inp: RewardInput) -> float:
    return float(inp.num_turns)


def test_get_reward_fn_by_name_and_import_path():
    assert get_reward_fn("math_answer") is math_answer
    assert {"math_answer", "math_answer_with_tool_bonus"} <= set(registered_rewards())
    assert get_reward_fn(f"{__name__}:custom_reward")(_inp("x")) == 2.0
    assert get_reward_fn(f"{__name__}.custom_reward") is custom_reward
    with pytest.raises(ValueError, match="unknown reward function"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="not callable"):
        get_reward_fn("streamrl.rollout.rewards:TOOL_SUCCESS_BONUS")


def test_register_reward_rejects_name_clash():
    register_reward("test_constant_one")(custom_reward)
    assert get_reward_fn("test_constant_one") is custom_reward
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_constant_one")(math_answer)


def _last_boxed_by_scanning(text: str) -> str | None:
    """The quadratic definition `last_boxed` must agree with: scan ahead from every `\\boxed{`."""
    import re

    result = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                result = text[start:i]
                break
    return result


def test_last_boxed_agrees_with_scanning_ahead_from_every_boxed():
    import random

    from streamrl.rollout.rewards import last_boxed

    rng = random.Random(0)
    pieces = ["\\boxed{", "\\fbox {", "{", "}", "}", "7", "x", " ", "\\boxed"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert last_boxed(text) == _last_boxed_by_scanning(text), text


@pytest.mark.timeout(60)
def test_last_boxed_is_linear_in_unclosed_boxes():
    """28k characters of unclosed `\\boxed{` took 6-9 s (quadratic); 4x as many must take well under
    a second. The bound is generous: the quadratic version needs ~100 s for this input."""
    import time

    from streamrl.rollout.rewards import extract_answer, last_boxed

    text = "\\boxed{" * 16_000  # 112k characters, no box closes
    t0 = time.perf_counter()
    assert last_boxed(text) is None and extract_answer(text + " 42") == "42"
    assert last_boxed(text + "7" + "}" * 16_000) == "7"  # all close: the last one is the innermost
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("score", [float("nan"), float("inf"), -float("inf")])
def test_verl_score_refuses_a_non_finite_score(score):
    import numpy as np

    from streamrl.rollout.rewards import verl_score

    with pytest.raises(ValueError, match="finite"):
        verl_score(np.float64(score))
    with pytest.raises(ValueError, match="finite"):
        verl_score({"score": score, "acc": 1.0})
