"""`FunctionTool`: a plain Python function with type hints and a docstring, used as a tool.

Most tools are one function. A `BaseTool` subclass plus a hand-written JSON schema for each is
boilerplate that drifts away from the code, so the schema is generated from what the function already
states: `inspect.signature` + `typing.get_type_hints` give the arguments, their JSON types and which
are required (those without a default); `inspect.getdoc` gives the description (the text before the
first section) and, from a Google-style `Args:` section, one description per argument. A YAML entry
`function: my_pkg.my_mod:my_fn` registers one (see `tools/config.py`); an explicit `tool_schema` there
replaces the generated schema.

Type hints map to JSON schema: `str` string, `int` integer, `float` number, `bool` boolean,
`list[X]` array of X, `dict[str, X]` object, `Literal[...]` and `Enum` classes an `enum` of their
values (an Enum parameter receives the member), `X | None` / `Optional[X]` adds "null", a union of
scalars lists their types, and `Annotated[X, "text"]` describes the argument with "text". Anything
else (no hint, `Any`, classes, `*args` / `**kwargs`, positional-only parameters) is a ValueError at
build time naming the function and the parameter: a schema the model cannot satisfy would otherwise
fail on every call. The schema sets `additionalProperties: false`, so the executor's validation
answers unknown arguments before the function runs.

Calls: the executor has validated the arguments against the schema. A sync function runs in a thread
of the tool's own bounded pool (`slots.ToolThreads`, `max_threads` calls at once, never the event
loop's default executor) so a slow one never blocks the event loop that generates for every other
trajectory; it must therefore be thread-safe, and one that outlives the executor's timeout keeps its
thread (and its slot) until it returns (threads cannot be cancelled): hung calls of one tool can only
exhaust that tool's slots. An async function is awaited on the loop. The
result becomes the observation: a `ToolExecution` passes through (its `images` included), a `str` is
the text, a list of content parts with at least one image (`[{"type": "text", "text": ...}, {"type":
"image", "image": SOURCE}]`, SOURCE as in `ToolExecution.images`) is the joined text plus those
images, anything else is JSON (`str()` when not JSON-serialisable). An exception raised by the
function is a problem the model can fix (it chose the input), so it comes back as the observation
`Error: ValueError: ...`.

Per tool, `bound` (the YAML entry's `config`) fixes keyword arguments the model never sees (a limit,
an endpoint), and `instance_id_param` names a parameter that receives the instance id, which is the
trajectory id, so a function can key per-trajectory state or side effects. `idempotent` (default
False) says a call interrupted by a worker's death may be re-run on resume.
"""

from __future__ import annotations

import enum
import inspect
import json
import logging
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.schema import OpenAIFunctionToolSchema
from streamrl.tools.slots import ToolThreads

logger = logging.getLogger(__name__)

_SCALARS: dict[Any, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}
_ARG_SECTIONS = {"Args", "Arguments", "Parameters", "Params", "Keyword Args", "Keyword Arguments"}
_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Returns?|Yields?|Raises|"
    r"Examples?|Notes?|Attributes|See Also|Warnings?|References|Todo):\s*$"
)
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
DEFAULT_MAX_THREADS = 8  # sync calls of one function tool running at once
_SUPPORTED = "use str, int, float, bool, list[...], dict[str, ...], Literal[...], an Enum or X | None"


# ---------------------------------------------------------------------------------------------------
# Docstring
# ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Docstring:
    """The parts of a docstring the schema uses."""

    description: str  # text before the first section; paragraphs kept, lines joined
    params: dict[str, str] = field(default_factory=dict)  # argument name -> its `Args:` description


def parse_docstring(doc: str | None) -> Docstring:
    """Split a cleaned docstring (`inspect.getdoc`) into its description and Google-style `Args:`."""
    lines = (doc or "").splitlines()
    start = next((i for i, line in enumerate(lines) if _SECTION.match(line)), len(lines))
    paragraphs = "\n".join(lines[:start]).strip().split("\n\n")
    description = "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())
    params: dict[str, str] = {}
    section, base_indent, current = None, None, None
    for line in lines[start:]:
        if (header := _SECTION.match(line)) is not None:
            section, base_indent, current = header.group(1), None, None
            continue
        if section not in _ARG_SECTIONS or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        base_indent = indent if base_indent is None else base_indent
        entry = _ARG_LINE.match(line.strip())
        if indent <= base_indent and entry is not None:
            current = entry.group(1)
            params[current] = entry.group(2).strip()
        elif current is not None:  # a continuation line of the current argument
            params[current] = f"{params[current]} {line.strip()}".strip()
    return Docstring(description=description, params=params)


# ---------------------------------------------------------------------------------------------------
# Type hints -> JSON schema
# ---------------------------------------------------------------------------------------------------


def type_schema(tp: Any, where: str) -> dict[str, Any]:
    """The JSON-schema node of one type hint; ValueError (starting with `where`) if it has none."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        schema = type_schema(args[0], where)
        notes = [a for a in args[1:] if isinstance(a, str)]
        return {**schema, "description": notes[0]} if notes else schema
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if origin is Literal:
        return _choices_schema(list(args), where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _choices_schema([member.value for member in tp], where)
    if tp is list or origin is list:
        return {"type": "array", **({"items": type_schema(args[0], f"{where} (items)")} if args else {})}
    if tp is dict or origin is dict:
        if args and args[0] is not str:
            raise ValueError(f"{where}: dict keys must be str (JSON object keys), got {args[0]!r}")
        if not args or args[1] is Any:
            return {"type": "object"}
        return {"type": "object", "additionalProperties": type_schema(args[1], f"{where} (values)")}
    if origin is Union or origin is types.UnionType:
        return _union_schema(args, where)
    raise ValueError(f"{where}: type {tp!r} cannot be described to the model as JSON; {_SUPPORTED}")


def _choices_schema(values: list[Any], where: str) -> dict[str, Any]:
    kinds: list[str] = []
    for value in values:
        kind = "null" if value is None else _SCALARS.get(type(value))
        if kind is None:
            raise ValueError(f"{where}: choice {value!r} is not a JSON string, number, boolean or null")
        if kind not in kinds:
            kinds.append(kind)
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _union_schema(args: tuple[Any, ...], where: str) -> dict[str, Any]:
    members = [a for a in args if a is not type(None)]
    schemas = [type_schema(m, where) for m in members]
    if len(schemas) == 1:
        schema = schemas[0]
    elif all(set(s) == {"type"} and isinstance(s["type"], str) for s in schemas):
        schema = {"type": list(dict.fromkeys(s["type"] for s in schemas))}
    else:
        raise ValueError(f"{where}: a union of structured types cannot be described; {_SUPPORTED}")
    return _nullable(schema) if len(members) < len(args) else schema


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    out = {**schema, "type": kinds if "null" in kinds else [*kinds, "null"]}
    if "enum" in out and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    return out


def _coerce(value: Any, tp: Any) -> Any:
    """JSON value -> what the annotation promises: an Enum member for its value, a float for a JSON
    integer where a float is declared (also inside lists, dicts and `X | None`); else unchanged."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _coerce(value, args[0])
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return value if isinstance(value, tp) else tp(value)
    if origin is list and args and isinstance(value, list):
        return [_coerce(v, args[0]) for v in value]
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return {k: _coerce(v, args[1]) for k, v in value.items()}
    if (origin is Union or origin is types.UnionType) and value is not None:
        members = [a for a in args if a is not type(None)]
        return _coerce(value, members[0]) if len(members) == 1 else value
    return value


# ---------------------------------------------------------------------------------------------------
# Signature -> tool schema
# ---------------------------------------------------------------------------------------------------


def describe(fn: Callable[..., Any]) -> str:
    """`module:qualname` of a callable, for error messages."""
    target = getattr(fn, "func", fn)  # functools.partial
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{getattr(target, '__module__', '?')}:{name}"


def _signature(fn: Callable[..., Any]) -> tuple[inspect.Signature, dict[str, Any]]:
    """The signature and the resolved type hints (string annotations included)."""
    target = getattr(fn, "func", fn)  # hints of a partial live on the wrapped function
    if not inspect.isroutine(target):
        target = type(target).__call__  # a callable object
    try:
        return inspect.signature(fn), typing.get_type_hints(target, include_extras=True)
    except Exception as exc:  # NameError for unresolvable annotations, TypeError for odd callables
        raise ValueError(f"{describe(fn)}: cannot read its signature and type hints: {exc}") from None


def function_schema(
    fn: Callable[..., Any], *, name: str | None = None, hidden: Collection[str] = ()
) -> OpenAIFunctionToolSchema:
    """The OpenAI tool schema of `fn`; parameters in `hidden` (bound by config) are left out."""
    label = describe(fn)
    sig, hints = _signature(fn)
    doc = parse_docstring(inspect.getdoc(fn))
    properties: dict[str, dict[str, Any]] = {}
    required: list[str] = []
    for param in sig.parameters.values():
        if param.name in hidden:
            continue
        where = f"{label}: parameter {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"{where}: *args / **kwargs cannot be described to the model; name each argument")
        if param.kind is param.POSITIONAL_ONLY:
            raise ValueError(f"{where}: positional-only parameters cannot be passed by name; drop the `/`")
        if param.name not in hints:
            raise ValueError(f"{where} has no type hint; {_SUPPORTED}")
        schema = type_schema(hints[param.name], where)
        if param.name in doc.params and "description" not in schema:
            schema = {**schema, "description": doc.params[param.name]}
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    tool_name = name or getattr(getattr(fn, "func", fn), "__name__", "")
    try:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": tool_name,
                    "description": doc.description,
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": required,
                        "additionalProperties": False,
                    },
                },
            }
        )
    except ValueError as exc:  # e.g. a lambda's name "<lambda>" is not a valid tool name
        raise ValueError(f"{label}: cannot build its tool schema (give `name`?): {exc}") from None


def _check_explicit_schema(
    schema: OpenAIFunctionToolSchema, sig: inspect.Signature, hidden: set[str], label: str
) -> None:
    """A hand-written schema must describe the function: it may only name its parameters, and must
    require every parameter without a default (else the model could omit it and every call fails)."""
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    declared = schema.function.parameters.properties
    foreign = sorted(k for k in declared if k in hidden or (k not in params and not takes_any))
    if foreign:
        raise ValueError(
            f"{label}: tool_schema declares argument(s) {foreign} the function does not take from the model"
        )
    needed = [
        p.name
        for p in params.values()
        if p.default is p.empty and p.name not in hidden and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    missing = [n for n in needed if n not in schema.function.parameters.required]
    if missing:
        raise ValueError(f"{label}: tool_schema must require argument(s) {missing} (they have no default)")


# ---------------------------------------------------------------------------------------------------
# The tool
# ---------------------------------------------------------------------------------------------------


def to_execution(result: Any) -> ToolExecution:
    """A function's return value as an observation."""
    if isinstance(result, ToolExecution):
        return result
    if isinstance(result, str):
        return ToolExecution(text=result)
    if is_image_parts(result):
        texts = [p.get("text", "") for p in result if p["type"] == "text"]
        return ToolExecution(text="\n".join(texts), images=[p.get("image") for p in result if p["type"] == "image"])
    try:
        return ToolExecution(text=json.dumps(result, ensure_ascii=False))
    except (TypeError, ValueError):
        return ToolExecution(text=str(result))


def is_image_parts(result: Any) -> bool:
    """True for a list of content parts (`{"type": "text", "text": ...}` / `{"type": "image", "image":
    SOURCE}`) holding at least one image: a function's way of returning images. Any other list stays
    JSON text, as before."""
    from streamrl.models.images import is_content_parts

    return is_content_parts(result) and any(p["type"] == "image" for p in result)


class FunctionTool(BaseTool):
    """Wraps one sync or async function; see the module docstring for the schema and call rules."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        tool_schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None,
        idempotent: bool = False,
        bound: Mapping[str, Any] | None = None,
        instance_id_param: str | None = None,
        max_threads: int = DEFAULT_MAX_THREADS,
    ) -> None:
        label = describe(fn)
        if isinstance(fn, type) or not callable(fn):
            raise ValueError(f"{label} is not a function (a BaseTool subclass goes under `class_name`)")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise ValueError(f"{label} is a generator; a tool function must return its result")
        sig, hints = _signature(fn)
        self.fn = fn
        self.bound = dict(bound or {})
        self.instance_id_param = instance_id_param
        hidden = set(self.bound) | ({instance_id_param} if instance_id_param else set())
        unknown = sorted(hidden - set(sig.parameters))
        if unknown:
            raise ValueError(
                f"{label}: config / instance_id_param name(s) {unknown} are not parameters of the function"
            )
        if tool_schema is None:
            schema = function_schema(fn, name=name, hidden=hidden)
        else:
            schema = OpenAIFunctionToolSchema.model_validate(
                tool_schema.model_dump() if isinstance(tool_schema, OpenAIFunctionToolSchema) else dict(tool_schema)
            )
            _check_explicit_schema(schema, sig, hidden, label)
            schema = schema.with_name(name) if name else schema
        super().__init__(config=None, tool_schema=schema)
        self.idempotent = idempotent  # per tool, shadows BaseTool's class default
        self._hints = {p: hints.get(p, Any) for p in sig.parameters if p not in hidden}
        self._takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        call = fn if inspect.isroutine(getattr(fn, "func", fn)) else type(fn).__call__
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)
        self.num_exceptions = 0  # calls the function answered with an exception (observed as errors)
        self.threads = ToolThreads(max_threads, name=self.name)  # sync functions only

    def _arguments(self, instance_id: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        unexpected = sorted(k for k in parameters if k not in self._hints and not self._takes_any)
        if unexpected:
            raise TypeError(f"unexpected argument(s) {unexpected}; allowed: {sorted(self._hints)}")
        kwargs = {k: _coerce(v, self._hints.get(k, Any)) for k, v in parameters.items()}
        kwargs.update(self.bound)
        if self.instance_id_param is not None:
            kwargs[self.instance_id_param] = instance_id
        return kwargs

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolExecution:
        try:
            kwargs = self._arguments(instance_id, parameters)
            if self._is_async:
                result = await self.fn(**kwargs)
            else:
                result = await self.threads.run(self.fn, **kwargs)
                if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
                    result = await result
            return to_execution(result)
        except Exception as exc:  # fault boundary: what the function raises is an observation
            self.num_exceptions += 1
            logger.info("function tool %s raised %s: %s", self.name, type(exc).__name__, exc)
            return ToolExecution(text=f"Error: {type(exc).__name__}: {exc}")
