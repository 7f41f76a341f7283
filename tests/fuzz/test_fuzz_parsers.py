"""Tool-call parsers (hermes, gpt-oss/harmony) on random and format-shaped text: a `ParsedTurn` whose
calls are well formed or carry an error, never an exception, in bounded time."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.rollout.parsers import ParsedTurn, get_parser

PARSERS = ["hermes", "gpt-oss"]
# Fragments of both wire formats, JSON pieces and noise: random mixes reach the parsers' odd corners.
FRAGMENTS = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|constrain|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        "assistant",
        "commentary",
        "final",
        "analysis",
        " to=functions.",
        "to=functions.calc ",
        "json",
        '{"name": "calc", "arguments": ',
        '{"expression": "1+1"}',
        '"parameters"',
        "{",
        "}",
        "[",
        "]",
        '"',
        ":",
        ",",
        "null",
        "1e400",
        "-0",
        "\\u0000",
        "\n",
        " ",
    ]
)
TEXT = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(FRAGMENTS, st.text(max_size=8)), max_size=40).map("".join),
)


def _check(turn: ParsedTurn) -> None:
    assert isinstance(turn, ParsedTurn) and isinstance(turn.content, str)
    assert turn.num_errors == sum(c.error is not None for c in turn.tool_calls)
    for i, call in enumerate(turn.tool_calls):
        assert call.call_id == f"call_{i}" and isinstance(call.name, str) and isinstance(call.arguments, dict)
        assert call.error is not None or call.name  # a call without a name is an error call


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parser_name", PARSERS)
@settings(max_examples=300, deadline=2000, derandomize=True)
@given(text=TEXT)
def test_any_text_parses_to_a_well_formed_turn(parser_name, text):
    _check(get_parser(parser_name).parse(text))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("parser_name", PARSERS)
@settings(max_examples=100, deadline=2000, derandomize=True)
@given(depth=st.integers(1, 5000), opener=st.sampled_from(["[", '{"a":']))
def test_deeply_nested_arguments_are_an_error_call_not_a_crash(parser_name, depth, opener):
    args = opener * depth
    text = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>',
        "gpt-oss": f"<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}<|call|>",
    }
    _check(get_parser(parser_name).parse(text[parser_name]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("parser_name", PARSERS)
@pytest.mark.parametrize(
    "pattern", ["<tool_call>", "<tool_call>{", "<|message|>", "to=functions.x<|message|>{}<|start|>"]
)
def test_a_degenerate_repeating_turn_parses_in_bounded_time(parser_name, pattern):
    text = pattern * (32_000 // len(pattern))  # ~8k tokens of a model stuck in a loop
    started = time.monotonic()
    _check(get_parser(parser_name).parse(text))
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("parser_name", PARSERS)
def test_a_call_with_a_huge_integer_is_an_error_call_not_an_exception(parser_name):
    digits = "1" * 5000
    text = {
        "hermes": f'<tool_call>{{"name": "calc", "arguments": {{"n": {digits}}}}}</tool_call>',
        "gpt-oss": (
            "<|start|>assistant<|channel|>commentary to=functions.calc "
            f'<|constrain|>json<|message|>{{"n": {digits}}}<|call|>'
        ),
    }
    _check(get_parser(parser_name).parse(text[parser_name]))
