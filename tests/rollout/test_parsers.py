"""Tool-call parsers (hermes, gpt-oss/harmony) and schema validation of parsed calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.rollout.parsers import ParsedTurn, get_parser
from streamrl.tools.schema import validate_call
from streamrl.tools.types import ToolCall

CALC_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "math",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
RICH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "k": {"type": "integer"},
                "score": {"type": "number"},
                "exact": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "filters": {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]},
                "mode": {"type": "string", "enum": ["fast", "deep"]},
            },
            "required": ["query"],
        },
    },
}


# -- hermes ------------------------------------------------------------------------------------------


def test_hermes_plain_text_has_no_calls():
    turn = get_parser("hermes").parse("  The answer is \\boxed{4}.  ")
    assert turn == ParsedTurn(content="The answer is \\boxed{4}.", tool_calls=[], num_errors=0)


def test_hermes_template_layout_with_text_around_and_many_calls():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "37 + 5 * 12"}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2**8\\"}"}</tool_call> done'
    )
    turn = get_parser("hermes").parse(text)
    assert turn.content == "Let me compute.\n\n done"
    assert [c.call_id for c in turn.tool_calls] == ["call_0", "call_1"]
    assert turn.tool_calls[0].arguments == {"expression": "37 + 5 * 12"}
    assert turn.tool_calls[1].arguments == {"expression": "2**8"}  # arguments given as a JSON string
    assert turn.num_errors == 0


@pytest.mark.parametrize(
    ("body", "name", "needle"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"', "calculator", "not valid JSON"),
        ('{"arguments": {"expression": "1"}}', "", 'no "name"'),
        ('{"name": 3, "arguments": {}}', "", 'no "name"'),
        ('{"name": "calculator", "arguments": [1, 2]}', "calculator", "must be a JSON object"),
        ('{"name": "calculator", "arguments": "not json"}', "calculator", "not valid JSON"),
        ("[1, 2]", "", "must be a JSON object"),
        ("   ", "", "empty tool call"),
    ],
)
def test_hermes_malformed_calls_become_error_calls(body, name, needle):
    turn = get_parser("hermes").parse(f"before <tool_call>{body}</tool_call> after")
    assert turn.content == "before  after"
    (call,) = turn.tool_calls
    assert call.error is not None and needle in call.error
    assert call.name == name and call.call_id == "call_0"
    assert turn.num_errors == 1


def test_hermes_unclosed_tag_is_an_error_with_best_guess():
    turn = get_parser("hermes").parse('ok <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}')
    (call,) = turn.tool_calls
    assert call.name == "calculator" and "unclosed" in call.error
    assert turn.content == "ok"


def test_hermes_unclosed_tag_followed_by_good_call():
    text = '<tool_call>{"name": "a"} <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    turn = get_parser("hermes").parse(text)
    assert [c.name for c in turn.tool_calls] == ["a", "b"]
    assert turn.tool_calls[0].error is not None and turn.tool_calls[1].error is None
    assert turn.num_errors == 1


def test_hermes_missing_arguments_and_parameters_alias():
    turn = get_parser("hermes").parse(
        '<tool_call>{"name": "noargs"}</tool_call><tool_call>{"name": "x", "parameters": {"a": 1}}</tool_call>'
    )
    assert [(c.name, c.arguments, c.error) for c in turn.tool_calls] == [("noargs", {}, None), ("x", {"a": 1}, None)]


# -- harmony -----------------------------------------------------------------------------------------


def test_harmony_analysis_calls_and_final():
    text = (
        "<|channel|>analysis<|message|>Need to multiply.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"
        '{"expression": "12*34"}<|call|>'
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>'
        "<|start|>assistant<|channel|>final<|message|>It is \\boxed{408}.<|return|>"
    )
    turn = get_parser("gpt-oss").parse(text)
    assert turn.content == "It is \\boxed{408}."
    assert [(c.call_id, c.name, c.arguments) for c in turn.tool_calls] == [
        ("call_0", "calculator", {"expression": "12*34"}),
        ("call_1", "lookup", {"q": "x"}),
    ]
    assert turn.num_errors == 0


def test_harmony_malformed_and_cut_off_calls():
    parser = get_parser("harmony")
    bad = parser.parse(
        '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": <|call|>'
    )
    assert bad.tool_calls[0].name == "calculator" and "not valid JSON" in bad.tool_calls[0].error
    # <|call|> is a stop token decoders drop: a complete JSON body without it is still a call.
    cut = parser.parse(
        '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "1+2"}'
    )
    assert cut.tool_calls[0].error is None and cut.tool_calls[0].arguments == {"expression": "1+2"}
    ended = parser.parse('<|channel|>commentary to=functions.calculator<|message|>{"expression": "1"}<|end|>')
    assert "<|call|>" in ended.tool_calls[0].error
    not_obj = parser.parse("<|channel|>commentary to=functions.f<|message|>[1]<|call|>")
    assert "JSON object" in not_obj.tool_calls[0].error and not_obj.num_errors == 1


def test_harmony_plain_text_and_commentary_fallback():
    parser = get_parser("gpt-oss")
    assert parser.parse("just text <|return|>").content == "just text"
    turn = parser.parse(
        "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>commentary<|message|>preamble<|end|>"
    )
    assert turn.content == "preamble" and turn.tool_calls == []


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_parser("nope")


# -- fuzzing -----------------------------------------------------------------------------------------

_TOKENS = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|call|>",
        "<|end|>",
        "<|return|>",
        "<|constrain|>",
        "to=functions.",
        "commentary",
        "final",
        '{"name": ',
        '"arguments": ',
        "{",
        "}",
        "[",
        '"',
        ":",
        ",",
    ]
)
_FUZZ_TEXT = st.lists(st.one_of(_TOKENS, st.text(max_size=8)), max_size=30).map("".join)


@settings(max_examples=250, deadline=None)
@given(text=_FUZZ_TEXT)
@pytest.mark.parametrize("parser_name", ["hermes", "gpt-oss"])
def test_no_text_crashes_a_parser(parser_name, text):
    turn = get_parser(parser_name).parse(text)
    assert turn.num_errors == sum(c.error is not None for c in turn.tool_calls)
    assert [c.call_id for c in turn.tool_calls] == [f"call_{i}" for i in range(len(turn.tool_calls))]


# Special tokens are single tokens on the wire, never text inside JSON: keep '<' and '|' out of strings.
_SAFE_TEXT = st.text(alphabet=st.characters(blacklist_characters="<|", blacklist_categories=("Cs",)), max_size=10)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | _SAFE_TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_SAFE_TEXT, children, max_size=3),
    max_leaves=8,
)
_CALLS = st.lists(
    st.tuples(
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True),
        st.dictionaries(_SAFE_TEXT, _JSON_VALUES, max_size=4),
    ),
    max_size=4,
)


@settings(max_examples=100, deadline=None)
@given(calls=_CALLS, content=st.text(alphabet=st.characters(blacklist_characters="<>|"), max_size=40))
@pytest.mark.parametrize("parser_name", ["hermes", "gpt-oss"])
def test_well_formed_calls_round_trip(parser_name, calls, content):
    parser = get_parser(parser_name)
    tool_calls = [ToolCall(call_id=f"call_{i}", name=n, arguments=a) for i, (n, a) in enumerate(calls)]
    turn = parser.parse(parser.render(content.strip(), tool_calls))
    assert turn.tool_calls == tool_calls
    assert turn.content == content.strip()
    assert turn.num_errors == 0


# -- validation --------------------------------------------------------------------------------------


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(call_id="call_0", name=name, arguments=arguments)


def test_validate_accepts_good_calls_and_coerces_integral_floats():
    ok = validate_call(
        _call("search", query="q", k=3.0, score=1, exact=True, tags=["a"], filters={"year": 2020}), [RICH_SCHEMA]
    )
    assert ok.error is None and ok.arguments["k"] == 3 and isinstance(ok.arguments["k"], int)
    assert validate_call(_call("calculator", expression="1+1"), {"calculator": CALC_SCHEMA}).error is None


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (_call("calc", expression="1"), "unknown tool 'calc'; available tools: calculator, search"),
        (_call("calculator"), "missing required argument(s) 'expression'"),
        (_call("calculator", expression=12), "'expression' must be of type string, got integer"),
        (_call("search", query="q", k="3"), "'k' must be of type integer, got string"),
        (_call("search", query="q", k=True), "'k' must be of type integer, got boolean"),
        (_call("search", query="q", k=2.5), "'k' must be of type integer, got number"),
        (_call("search", query="q", score="high"), "'score' must be of type number"),
        (_call("search", query="q", exact="yes"), "'exact' must be of type boolean"),
        (_call("search", query="q", tags="a,b"), "'tags' must be of type array"),
        (_call("search", query="q", tags=["a", 1]), "'tags[1]' must be of type string"),
        (_call("search", query="q", filters=[1]), "'filters' must be of type object"),
        (_call("search", query="q", filters={}), "missing required argument(s) 'filters.year'"),
        (_call("search", query="q", mode="slow"), "must be one of ['fast', 'deep']"),
    ],
)
def test_validate_reports_helpful_errors(call, needle):
    checked = validate_call(call, [CALC_SCHEMA, RICH_SCHEMA])
    assert checked.error is not None and needle in checked.error, checked.error
    assert checked.call_id == call.call_id and checked.name == call.name


def test_validate_keeps_parse_errors():
    broken = ToolCall(call_id="call_0", name="", error="bad json")
    assert validate_call(broken, [CALC_SCHEMA]) is broken


def test_render_is_valid_json_per_call():
    text = get_parser("hermes").render("hi", [_call("calculator", expression="1")])
    body = text.split("<tool_call>")[1].split("</tool_call>")[0]
    assert json.loads(body) == {"name": "calculator", "arguments": {"expression": "1"}}
