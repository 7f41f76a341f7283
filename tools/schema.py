"""OpenAI function-tool schema, validated with pydantic, and the check of a parsed call against it.

This is what the chat template receives in `tools=[...]` (via `ToolRegistry.schemas()`), what
`validate_call` checks a parsed call against (unknown tool, missing required arguments, wrong JSON
types), and what verl's tool configs carry under `tool_schema`. Property schemas allow extra
JSON-schema keywords (`minimum`, `pattern`, ...) because they are passed through to the model
verbatim; the envelope itself is strict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.tools.types import ToolCall


class OpenAIFunctionPropertySchema(BaseModel):
    """One JSON-schema node describing an argument (nested `items` / `properties` stay plain dicts)."""

    model_config = ConfigDict(extra="allow")

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None
    items: dict[str, Any] | None = None
    properties: dict[str, Any] | None = None
    required: list[str] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["object"] = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)
    additionalProperties: bool | None = None  # noqa: N815 (JSON-schema spelling)

    @model_validator(mode="after")
    def _required_are_declared(self) -> OpenAIFunctionParametersSchema:
        undeclared = [name for name in self.required if name not in self.properties]
        if undeclared:
            raise ValueError(f"required argument(s) {undeclared} are not declared in properties")
        return self


class OpenAIFunctionSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool | None = None


class OpenAIFunctionToolSchema(BaseModel):
    """`{"type": "function", "function": {"name", "description", "parameters": {...}}}`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema

    @property
    def name(self) -> str:
        return self.function.name

    def to_openai(self) -> dict[str, Any]:
        """Plain dict for chat templates and `validate_call` (unset optional keys dropped)."""
        return self.model_dump(exclude_none=True)

    @classmethod
    def one_string_argument(
        cls, name: str, description: str, argument: str, argument_description: str
    ) -> OpenAIFunctionToolSchema:
        """A function of one required string argument (the shape of the built-in tools)."""
        return cls.model_validate(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": {argument: {"type": "string", "description": argument_description}},
                        "required": [argument],
                    },
                },
            }
        )

    def with_name(self, name: str) -> OpenAIFunctionToolSchema:
        return self.model_copy(update={"function": self.function.model_copy(update={"name": name})})


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
