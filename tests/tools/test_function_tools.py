"""Function tools: schema generation from signatures and docstrings, sync/async execution, errors as
observations, validation through the executor, YAML loading (`function:` entries) and build errors."""

from __future__ import annotations

import asyncio
import threading
import time
from enum import Enum, IntEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest

from streamrl.tools import ToolRegistry, load_tool_config
from streamrl.tools.base import ToolExecution
from streamrl.tools.function import (
    FunctionTool,
    function_schema,
    parse_docstring,
)
from streamrl.tools.types import ToolCall
from streamrl.workloads.tools.examples import lookup_constant, word_count

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tools"
HERE = "tests.tools.test_function_tools"


def _params(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": _params(properties, required)},
    }


# -- functions used by the tests (module level: the YAML tests import them by path) --------------------


class Color(Enum):
    RED = "red"
    GREEN = "green"


class Level(IntEnum):
    LOW = 1
    HIGH = 2


def kitchen_sink(
    s: str,
    i: int,
    f: float,
    b: bool,
    tags: list[str],
    grid: list[list[int]],
    counts: dict[str, int],
    blob: dict,
    mode: Literal["fast", "slow"] = "fast",
    color: Color | None = None,
    level: Level | None = None,
    maybe: int | None = None,
    either: int | str = 0,
    note: Annotated[str, "a note from Annotated"] = "",
    anything: dict[str, Any] | None = None,
) -> str:
    """Exercise every supported annotation.

    A second paragraph
    spread over two lines.

    Args:
        s: A string.
        i (int): An integer, described
            over two lines.
        tags: Some tags.
        note: Overridden by the Annotated text.

    Returns:
        Nothing useful.
    """
    return "ok"


def shout(text: str, times: int = 1) -> str:
    """Upper-case a text."""
    return " ".join([text.upper()] * times)


def paint(color: Color, levels: list[Level], scale: float | None = None) -> dict:
    """Return what the function received, with types."""
    return {
        "color": type(color).__name__ + "." + color.name,
        "levels": [type(x).__name__ for x in levels],
        "scale": type(scale).__name__,
    }


CALLS: list[tuple[str, int]] = []


def record_call(key: str, n: int) -> str:
    """Record the call (to prove validation stops bad calls before the function runs)."""
    CALLS.append((key, n))
    return f"{key}:{n}"


def which_thread(delay_s: float = 0.0) -> int:
    """The id of the thread this runs in."""
    time.sleep(delay_s)
    return threading.get_ident()


async def which_thread_async() -> int:
    """The id of the thread this runs in (the event loop's)."""
    await asyncio.sleep(0)
    return threading.get_ident()


def failing(x: int) -> str:
    """Always fails."""
    raise ValueError(f"x={x} is not allowed")


async def failing_async(x: int) -> str:
    """Always fails, asynchronously."""
    raise KeyError("missing")


def returns(kind: str) -> Any:
    """Return a value of the named kind."""
    return {
        "str": "plain",
        "int": 42,
        "dict": {"a": [1, 2], "é": True},
        "none": None,
        "object": _Opaque(),
        "execution": ToolExecution(text="custom", reward=0.5, metrics={"m": 1.0}),
    }[kind]


class _Opaque:
    def __str__(self) -> str:
        return "<opaque>"


def remember(key: str, trajectory_id: str, prefix: str = "") -> str:
    """Key a value by trajectory."""
    return f"{prefix}{trajectory_id}/{key}"


# -- schema generation ------------------------------------------------------------------------------


def test_schema_of_example_functions():
    assert function_schema(word_count).to_openai() == _tool(
        "word_count",
        "Count the words of a text (runs of characters between whitespace).",
        {"text": {"type": "string", "description": "The text whose words are counted."}},
        ["text"],
    )
    assert function_schema(lookup_constant).to_openai() == _tool(
        "lookup_constant",
        "Look up a mathematical constant.",
        {
            "name": {"type": "string", "enum": ["pi", "e", "tau", "golden_ratio"], "description": "Which constant."},
            "digits": {"type": "integer", "description": "Digits after the decimal point, 0 to 15."},
        },
        ["name"],
    )


def test_schema_maps_every_supported_annotation():
    assert function_schema(kitchen_sink).to_openai() == _tool(
        "kitchen_sink",
        "Exercise every supported annotation.\n\nA second paragraph spread over two lines.",
        {
            "s": {"type": "string", "description": "A string."},
            "i": {"type": "integer", "description": "An integer, described over two lines."},
            "f": {"type": "number"},
            "b": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "Some tags."},
            "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
            "blob": {"type": "object"},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "color": {"type": ["string", "null"], "enum": ["red", "green", None]},
            "level": {"type": ["integer", "null"], "enum": [1, 2, None]},
            "maybe": {"type": ["integer", "null"]},
            "either": {"type": ["integer", "string"]},
            "note": {"type": "string", "description": "a note from Annotated"},
            "anything": {"type": ["object", "null"]},
        },
        ["s", "i", "f", "b", "tags", "grid", "counts", "blob"],
    )


def test_schema_name_and_hidden_parameters():
    schema = function_schema(remember, name="kv", hidden={"trajectory_id", "prefix"}).to_openai()
    assert schema == _tool("kv", "Key a value by trajectory.", {"key": {"type": "string"}}, ["key"])


def test_parse_docstring_sections():
    doc = parse_docstring(
        "Summary line.\n\nDetails here.\n\nArgs:\n    a: First.\n    *rest: Ignored by schemas.\n"
        "    b (list[int], optional): Second,\n        continued.\n\nRaises:\n    ValueError: not an argument.\n"
    )
    assert doc.description == "Summary line.\n\nDetails here."
    assert doc.params == {"a": "First.", "rest": "Ignored by schemas.", "b": "Second, continued."}
    assert parse_docstring(None).description == "" and parse_docstring("Only a summary.").params == {}


# -- execution ----------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
async def test_sync_functions_run_in_threads_and_async_ones_on_the_loop():
    loop_thread = threading.get_ident()
    sync_tool, async_tool = FunctionTool(which_thread), FunctionTool(which_thread_async)
    assert int((await sync_tool.execute("i", {})).text) != loop_thread
    assert int((await async_tool.execute("i", {})).text) == loop_thread
    # Blocking sync calls neither block the loop nor each other.
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    start = time.perf_counter()
    await asyncio.gather(*(sync_tool.execute("i", {"delay_s": 0.2}) for _ in range(3)))
    elapsed = time.perf_counter() - start
    ticker.cancel()
    assert elapsed < 0.5 and ticks >= 5


@pytest.mark.parametrize(
    ("kind", "text"),
    [("str", "plain"), ("int", "42"), ("dict", '{"a": [1, 2], "é": true}'), ("none", "null"), ("object", "<opaque>")],
)
async def test_return_values_become_observation_text(kind, text):
    assert await FunctionTool(returns).execute("i", {"kind": kind}) == ToolExecution(text=text)


async def test_returned_tool_execution_passes_through():
    out = await FunctionTool(returns).execute("i", {"kind": "execution"})
    assert out == ToolExecution(text="custom", reward=0.5, metrics={"m": 1.0})


async def test_exceptions_become_error_observations():
    tool, atool = FunctionTool(failing), FunctionTool(failing_async)
    assert (await tool.execute("i", {"x": 3})).text == "Error: ValueError: x=3 is not allowed"
    assert (await atool.execute("i", {"x": 3})).text == "Error: KeyError: 'missing'"
    assert (await tool.execute("i", {})).text.startswith("Error: TypeError: ")  # called without the executor
    assert tool.num_exceptions == 2 and atool.num_exceptions == 1


async def test_arguments_arrive_as_annotated_enum_members_and_floats():
    out = await FunctionTool(paint).execute("i", {"color": "green", "levels": [1, 2], "scale": 2})
    assert out.text == '{"color": "Color.GREEN", "levels": ["Level", "Level"], "scale": "float"}'
    out = await FunctionTool(paint).execute("i", {"color": "red", "levels": []})
    assert out.text == '{"color": "Color.RED", "levels": [], "scale": "NoneType"}'


async def test_bound_config_and_instance_id_parameter():
    tool = FunctionTool(remember, bound={"prefix": "p:"}, instance_id_param="trajectory_id", idempotent=True)
    assert tool.schema.to_openai() == _tool(
        "remember", "Key a value by trajectory.", {"key": {"type": "string"}}, ["key"]
    )
    assert tool.idempotent and not FunctionTool(remember).idempotent
    assert (await tool.execute("traj-7", {"key": "k"})).text == "p:traj-7/k"
    # The model cannot set hidden parameters, even by calling execute directly.
    spoofed = await tool.execute("traj-7", {"key": "k", "trajectory_id": "other"})
    assert spoofed.text == "Error: TypeError: unexpected argument(s) ['trajectory_id']; allowed: ['key']"


@pytest.mark.timeout(10)
async def test_executor_validates_arguments_before_the_function_runs():
    CALLS.clear()
    registry = ToolRegistry([FunctionTool(record_call), FunctionTool(failing), FunctionTool(lookup_constant)])
    ids = await registry.create_instances()

    def call(i: int, tool: str, **arguments: Any) -> ToolCall:
        return ToolCall(call_id=f"call_{i}", name=tool, arguments=arguments)

    calls = [
        call(0, "record_call", key="a", n=3.0),  # integral float coerced to int by validation
        call(1, "record_call", key="a"),
        call(2, "record_call", key="a", n="three"),
        call(3, "record_call", key="a", n=1, extra=True),
        call(4, "lookup_constant", name="phi"),
        call(5, "lookup_constant", name="e", digits=3),
        call(6, "failing", x=1),
    ]
    results = await registry.execute_calls(calls, ids, timeout_s=5, max_parallel=8)
    texts = [r.text for r in results]
    assert texts[0] == "a:3" and CALLS == [("a", 3)] and isinstance(CALLS[0][1], int)
    assert "missing required argument(s) 'n'" in texts[1]
    assert "argument 'n' must be of type integer" in texts[2]
    assert "unexpected argument(s) ['extra']" in texts[3]
    assert "argument 'name' must be one of ['pi', 'e', 'tau', 'golden_ratio']" in texts[4]
    assert texts[5] == "2.718"
    assert texts[6] == "Error: ValueError: x=1 is not allowed"
    assert [r.is_error for r in results] == [False, True, True, True, True, False, True]
    assert (registry.num_validation_errors, registry.num_exceptions, registry.num_executed) == (4, 0, 3)
    await registry.release_instances(ids)


# -- YAML loading -------------------------------------------------------------------------------------


async def test_load_shipped_function_config():
    registry = load_tool_config(CONFIGS / "functions.yaml")
    assert registry.names == ["word_count", "constant", "convert_length", "calculator"]
    assert [registry.is_idempotent(n) for n in registry.names] == [True, True, False, True]
    schemas = {s["function"]["name"]: s for s in registry.schemas()}
    assert schemas["word_count"] == function_schema(word_count).to_openai()
    assert schemas["constant"]["function"]["description"] == "Look up a mathematical constant."
    assert "precision" not in schemas["convert_length"]["function"]["parameters"]["properties"]
    calls = [
        ToolCall(call_id="call_0", name="word_count", arguments={"text": "one two  three"}),
        ToolCall(call_id="call_1", name="constant", arguments={"name": "pi", "digits": 2}),
        ToolCall(call_id="call_2", name="convert_length", arguments={"value": 1, "from_unit": "mi", "to_unit": "km"}),
    ]
    results = await registry.execute_calls(calls, {}, timeout_s=5, max_parallel=4)
    assert [r.text for r in results] == ["3", "3.14", "1.609"]


def test_load_function_entries_from_a_file_with_rename_and_explicit_schema(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        f"  - function: {HERE}:shout\n"
        "    name: loud\n"
        "    idempotent: true\n"
        f"  - function: {HERE}.remember\n"
        "    instance_id_param: trajectory_id\n"
        "    config: {type: native, prefix: 'x-'}\n"
        f"  - function: {HERE}:shout\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: yell\n"
        "        description: Shout it.\n"
        "        parameters: {type: object, properties: {text: {type: string}}, required: [text]}\n"
    )
    registry = load_tool_config(path)
    assert registry.names == ["loud", "remember", "yell"]
    assert registry.is_idempotent("loud") and not registry.is_idempotent("remember")
    assert registry.get("loud").schema.function.parameters.required == ["text"]
    assert registry.schemas()[2] == {
        "type": "function",
        "function": {
            "name": "yell",
            "description": "Shout it.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    }
    assert asyncio.run(registry.get("remember").execute("t1", {"key": "k"})).text == "x-t1/k"


def test_load_function_entry_from_a_dict_renamed_by_schema_and_name():
    registry = load_tool_config(
        {"tools": [{"function": f"{HERE}:shout", "name": "loud", "tool_schema": function_schema(shout).to_openai()}]}
    )
    assert registry.names == ["loud"]


# -- build-time errors --------------------------------------------------------------------------------


def no_hint(x, y: int) -> int:
    """x has no hint."""
    return y


def star_args(*values: int) -> int:
    """Variadic."""
    return 0


def star_kwargs(**options: int) -> int:
    """Keyword-variadic."""
    return 0


def positional_only(x: int, /) -> int:
    """Positional-only."""
    return x


def takes_any(x: Any) -> int:
    """Any."""
    return 0


def takes_set(x: set[int]) -> int:
    """A set."""
    return 0


def int_keys(x: dict[int, str]) -> int:
    """Non-string keys."""
    return 0


def structured_union(x: list[int] | dict[str, int]) -> int:
    """Union of structures."""
    return 0


def object_choice(x: Literal[b"raw"]) -> int:  # bytes are no JSON scalar
    """Bad choice."""
    return 0


def generator(x: int):
    """A generator."""
    yield x


def unresolvable(x: NoSuchType) -> int:  # noqa: F821 (the point of the test)
    """Forward reference that does not resolve."""
    return 0


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (no_hint, "no_hint: parameter 'x' has no type hint"),
        (star_args, "star_args: parameter 'values': *args / **kwargs"),
        (star_kwargs, "star_kwargs: parameter 'options': *args / **kwargs"),
        (positional_only, "positional_only: parameter 'x': positional-only"),
        (takes_any, "takes_any: parameter 'x': type typing.Any cannot be described"),
        (takes_set, "takes_set: parameter 'x': type set[int] cannot be described"),
        (int_keys, "int_keys: parameter 'x': dict keys must be str"),
        (structured_union, "structured_union: parameter 'x': a union of structured types"),
        (object_choice, "object_choice: parameter 'x': choice b'raw' is not a JSON"),
        (generator, "generator is a generator"),
        (unresolvable, "unresolvable: cannot read its signature and type hints"),
        (lambda x: x, "<lambda>: parameter 'x' has no type hint"),
        (Color, "is not a function"),
        (42, "is not a function"),
    ],
)
def test_unsupported_functions_fail_at_build_time_naming_function_and_parameter(fn, needle):
    with pytest.raises(ValueError) as info:
        FunctionTool(fn)
    message = str(info.value)
    assert needle in message, message
    if callable(fn) and not isinstance(fn, type):
        assert f"{HERE}:" in message  # names the function by module:qualname


def test_bad_bound_and_explicit_schemas_fail_at_build_time():
    with pytest.raises(ValueError, match=r"shout: config / instance_id_param name\(s\) \['loud'\]"):
        FunctionTool(shout, bound={"loud": True})
    schema = function_schema(shout).to_openai()
    schema["function"]["parameters"]["properties"]["volume"] = {"type": "integer"}
    with pytest.raises(ValueError, match=r"declares argument\(s\) \['volume'\]"):
        FunctionTool(shout, tool_schema=schema)
    optional_text = {"function": {"name": "shout", "parameters": {"properties": {"text": {"type": "string"}}}}}
    with pytest.raises(ValueError, match=r"must require argument\(s\) \['text'\]"):
        FunctionTool(shout, tool_schema=optional_text)
    with pytest.raises(ValueError, match="give `name`"):
        FunctionTool(lambda: 1)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        (
            {"function": f"{HERE}:shout", "class_name": "streamrl.tools.calculator.CalculatorTool"},
            "tool #0 (streamrl.tools.calculator.CalculatorTool): give either `class_name`",
        ),
        ({"function": "streamrl.workloads.tools.examples:CONSTANTS"}, "is a dict, not a function"),
        ({"function": "streamrl.tools.calculator:CalculatorTool"}, "is a class, not a function"),
        ({"function": "no_such_pkg.mod:fn"}, "tool #0 (no_such_pkg.mod:fn): cannot import module 'no_such_pkg.mod'"),
        ({"function": f"{HERE}:no_such_fn"}, f"module '{HERE}' has no attribute 'no_such_fn'"),
        ({"function": f"{HERE}:no_hint"}, "tool #0 (tests.tools.test_function_tools:no_hint): tests.tools"),
        ({"function": f"{HERE}:shout", "config": {"type": "mcp"}}, "only 'native'"),
        ({"function": f"{HERE}:shout", "config": {"volume": 11}}, "['volume'] are not parameters"),
        (
            {"name": "calculator", "idempotent": True},
            "tool #0 (calculator): `idempotent` and `instance_id_param` apply",
        ),
        ({"config": {}}, "needs `name` (a built-in tool), `class_name` or `function`"),
        ({"function": f"{HERE}:shout", "idempotnet": True}, "idempotnet"),
    ],
)
def test_bad_function_entries_raise_value_errors_naming_the_entry(entry, needle):
    with pytest.raises(ValueError) as info:
        load_tool_config({"tools": [entry]})
    assert needle in str(info.value), str(info.value)
