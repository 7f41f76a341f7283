"""Tool-call parser interface, parser registry and JSON-schema validation of parsed calls.

An agent loop decodes one assistant turn to text and hands it to a `ToolParser`, which splits it into
the visible `content` and a list of `ToolCall`s. Parsers never raise on model output: a malformed call
becomes a `ToolCall` with `error` set (and the best-guess name, or ""), so the loop can answer it with
an error observation the model can learn from. `validate_call` then checks a well-formed call against
the OpenAI function schemas of the registered tools (unknown tool, missing required arguments, wrong
JSON types) before anything is executed.
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from streamrl.core.registry import Registry
from streamrl.rollout.types import ToolCall


@dataclass(kw_only=True, slots=True)
class ParsedTurn:
    """One assistant turn split into text and tool calls. `num_errors` counts calls with `error`."""

    content: str  # text outside tool calls (harmony: the final channel)
    tool_calls: list[ToolCall] = field(default_factory=list)  # [num_calls], in emission order
    num_errors: int = 0


class ToolParser(abc.ABC):
    """Turns decoded assistant text into a `ParsedTurn`; `render` is the exact inverse for well-formed
    calls (used by tests, fake engines and SFT data)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """Parse one assistant turn. Must not raise for any input string."""

    @abc.abstractmethod
    def render(self, content: str, calls: Iterable[ToolCall]) -> str:
        """Write `content` and `calls` in this parser's wire format."""


PARSERS: Registry[type[ToolParser]] = Registry("tool parser")


def register_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def wrap(cls: type[ToolParser]) -> type[ToolParser]:
        PARSERS.register(name)(cls)
        if "name" not in cls.__dict__:  # an alias keeps the canonical name
            cls.name = name
        return cls

    return wrap


def get_parser(name: str) -> ToolParser:
    """A fresh parser by registry name ("hermes", "gpt-oss"; "harmony" is an alias of "gpt-oss")."""
    # Importing the implementations registers them; kept here so `base` has no import cycle.
    from streamrl.rollout.parsers import harmony, hermes  # noqa: F401

    return PARSERS.get(name)()


def load_json(text: str) -> tuple[Any, str | None]:
    """(value, None) for valid JSON, else (None, why not), for an error call's message. Model output
    can fail `json.loads` three ways, none of them a bug: bad syntax, nesting past the recursion
    limit, and a plain ValueError for an integer of more than 4300 digits (Python's int limit)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at character {exc.pos}"
    except RecursionError:
        return None, "nesting too deep"
    except ValueError as exc:
        return None, str(exc).partition(";")[0]  # drop the advice to raise the interpreter's limit


def make_error_call(index: int, error: str, name: str = "", arguments: dict[str, Any] | None = None) -> ToolCall:
    return ToolCall(call_id=call_id_for(index), name=name, arguments=arguments or {}, error=error)


def call_id_for(index: int) -> str:
    """Deterministic per position in the turn, so a re-parse after resume yields the same ids."""
    return f"call_{index}"


# ---------------------------------------------------------------------------------------------------
# Validation against OpenAI function schemas
# ---------------------------------------------------------------------------------------------------

_JSON_TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _type_name(value: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _matches_type(value: Any, json_type: str) -> tuple[bool, Any]:
    """(matches, value coerced to the type). Integral floats count as integers (models write 3.0)."""
    if json_type == "string":
        return isinstance(value, str), value
    if json_type == "boolean":
        return isinstance(value, bool), value
    if json_type == "integer":
        if isinstance(value, bool):
            return False, value
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return True, int(value)
        return False, value
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if json_type == "array":
        return isinstance(value, list), value
    if json_type == "object":
        return isinstance(value, dict), value
    if json_type == "null":
        return value is None, value
    return True, value  # unknown type keyword: do not reject what we cannot check


def _check_value(value: Any, schema: Mapping[str, Any], path: str) -> tuple[str | None, Any]:
    """(error message or None, coerced value) for one value against one JSON-schema node."""
    declared = schema.get("type")
    if declared is not None:
        types = [declared] if isinstance(declared, str) else list(declared)
        for json_type in types:
            ok, coerced = _matches_type(value, json_type)
            if ok:
                value = coerced
                break
        else:
            wanted = " or ".join(types)
            return f"argument '{path}' must be of type {wanted}, got {_type_name(value)} {value!r:.60}", value
    enum = schema.get("enum")
    if enum is not None and value not in enum:
        return f"argument '{path}' must be one of {list(enum)}, got {value!r:.60}", value
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        out = []
        for i, item in enumerate(value):
            err, item = _check_value(item, schema["items"], f"{path}[{i}]")
            if err:
                return err, value
            out.append(item)
        value = out
    if isinstance(value, dict) and isinstance(schema.get("properties"), Mapping):
        err, value = _check_object(value, schema, path)
        if err:
            return err, value
    return None, value


def _check_object(args: dict[str, Any], schema: Mapping[str, Any], path: str) -> tuple[str | None, dict]:
    props: Mapping[str, Any] = schema.get("properties") or {}
    prefix = f"{path}." if path else ""
    missing = [k for k in schema.get("required") or [] if k not in args]
    if missing:
        names = ", ".join(f"'{prefix}{k}'" for k in missing)
        return f"missing required argument(s) {names}", args
    if schema.get("additionalProperties") is False:
        extra = sorted(k for k in args if k not in props)
        if extra:
            return f"unexpected argument(s) {extra}; allowed: {sorted(props)}", args
    out = dict(args)
    for key, value in args.items():
        if key in props and isinstance(props[key], Mapping):
            err, out[key] = _check_value(value, props[key], f"{prefix}{key}")
            if err:
                return err, args
    return None, out


def _function_schemas(schemas: Iterable[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping]:
    """Accept a list of OpenAI tool schemas ({"type": "function", "function": {...}} or the bare
    function dict) or a mapping name -> schema; return name -> function dict."""
    items = schemas.values() if isinstance(schemas, Mapping) else schemas
    out: dict[str, Mapping] = {}
    for schema in items:
        fn = schema.get("function", schema)
        out[fn["name"]] = fn
    return out


def validate_call(call: ToolCall, schemas: Iterable[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]) -> ToolCall:
    """Return `call` (arguments coerced, e.g. 3.0 -> 3 for integers) or a copy with `error` set.

    Calls that already carry a parse error are returned unchanged."""
    if call.error is not None:
        return call
    functions = _function_schemas(schemas)
    fn = functions.get(call.name)
    if fn is None:
        known = ", ".join(sorted(functions)) or "none"
        return call.model_copy(update={"error": f"unknown tool '{call.name}'; available tools: {known}"})
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    err, args = _check_object(call.arguments, params, "")
    if err:
        return call.model_copy(update={"error": f"invalid arguments for tool '{call.name}': {err}"})
    return call.model_copy(update={"arguments": args})
