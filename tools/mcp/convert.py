"""MCP <-> OpenAI conversions for the MCP toolsets (`tools/mcp/`) (pure functions): an MCP tool's `inputSchema` as
OpenAI function parameters, and a `CallToolResult` as one observation: its text, and the images it
carries for a VLM policy (`result_execution`).

Images: each `ImageContent` part of a successful result becomes one image of the `ToolExecution`, in
part order, as a `data:<mime>;base64,<data>` URL (a source the executor reads; it decodes, stores or
refuses them, all or none, like any tool's images). The text is the other parts, described as in
`result_text`. A result the server flagged `isError` shows no image: its observation is the error text
alone (images described in one line each), since an error is what the model must read, and an image
it cannot act on would only cost placeholder tokens. Audio and binary resources stay one-line
descriptions (the policy has no ears). A result without images is exactly `result_text`.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from streamrl.tools.base import ToolExecution
from streamrl.tools.schema import OpenAIFunctionToolSchema

if TYPE_CHECKING:
    import mcp_types

_ANY_JSON_TYPE = ["string", "number", "integer", "boolean", "array", "object", "null"]


def openai_parameters(input_schema: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An MCP `inputSchema` as OpenAI function `parameters`.

    Local `$ref`s into `$defs` are inlined (chat templates show the schema verbatim and our argument
    validation does not follow references), titles are dropped (pydantic generates one per node; they
    cost prompt tokens and say nothing the name does not), and a property without `type` gets one:
    the types of its `anyOf` / `oneOf` members (what `X | None` becomes), else every JSON type.
    Everything else (descriptions, defaults, enums, bounds) passes through."""
    schema = _inline_refs(dict(input_schema), input_schema.get("$defs") or input_schema.get("definitions") or {}, 0)
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}: inputSchema has type {schema.get('type')!r}; tool arguments must be an object")
    properties = {name: _with_type(_strip_titles(node)) for name, node in (schema.get("properties") or {}).items()}
    out: dict[str, Any] = {"type": "object", "properties": properties, "required": list(schema.get("required") or [])}
    if isinstance(schema.get("additionalProperties"), bool):
        out["additionalProperties"] = schema["additionalProperties"]
    return out


def _inline_refs(node: Any, defs: Mapping[str, Any], depth: int) -> Any:
    if isinstance(node, list):
        return [_inline_refs(item, defs, depth) for item in node]
    if not isinstance(node, Mapping):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.rsplit("/", 1)[-1] in defs and depth < 16:  # recursive models stop here
        target = {**defs[ref.rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline_refs(target, defs, depth + 1)
    return {
        k: _inline_refs(v, defs, depth) for k, v in node.items() if k not in ("$defs", "definitions", "$ref", "$schema")
    }


def _strip_titles(node: Any) -> Any:
    """Drop the `title` keyword of every schema node (not a property that is named "title")."""
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    if not isinstance(node, Mapping):
        return node
    out = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key == "properties" and isinstance(value, Mapping):
            out[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        else:
            out[key] = _strip_titles(value)
    return out


def _with_type(node: Mapping[str, Any]) -> dict[str, Any]:
    if "type" in node:
        return dict(node)
    kinds: list[str] = []
    for member in node.get("anyOf") or node.get("oneOf") or []:
        member_type = member.get("type") if isinstance(member, Mapping) else None
        if member_type is None:
            return {"type": _ANY_JSON_TYPE, **node}
        for kind in [member_type] if isinstance(member_type, str) else member_type:
            if kind not in kinds:
                kinds.append(kind)
    return {"type": (kinds[0] if len(kinds) == 1 else kinds) if kinds else _ANY_JSON_TYPE, **node}


def tool_schema(tool: mcp_types.Tool, name: str) -> OpenAIFunctionToolSchema:
    """The OpenAI schema of one MCP tool, exposed under `name`."""
    where = f"MCP tool {tool.name!r}"
    try:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": tool.description or tool.title or "",
                    "parameters": openai_parameters(tool.input_schema, where),
                },
            }
        )
    except ValueError as exc:
        raise ValueError(f"{where} cannot be offered to the model (leave it out with `exclude`): {exc}") from None


def result_text(result: mcp_types.CallToolResult) -> str:
    """A `CallToolResult` as one observation: text parts joined by newlines, other parts described in
    one line each, the structured result as JSON when there is no content, and "Error: " in front
    when the server flagged the result `isError`."""
    parts = [_describe_part(part) for part in result.content]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content, ensure_ascii=False)]
    text = "\n".join(parts)
    if result.is_error:
        return f"Error: {text}" if text else "Error: the tool reported an error without a message"
    return text


def result_execution(result: mcp_types.CallToolResult) -> ToolExecution:
    """A `CallToolResult` as the tool's execution: image parts as images, the rest as text (see the
    module docstring); an error result, or one without images, is `result_text` alone."""
    images = [part for part in result.content if _is_image(part)]
    if result.is_error or not images:
        return ToolExecution(text=result_text(result))
    text = "\n".join(_describe_part(part) for part in result.content if not _is_image(part))
    return ToolExecution(text=text, images=[f"data:{part.mime_type};base64,{part.data}" for part in images])


def _is_image(part: Any) -> TypeGuard[mcp_types.ImageContent]:
    return getattr(part, "type", None) == "image"


def _describe_part(part: Any) -> str:
    kind = getattr(part, "type", "?")
    if kind == "text":
        return part.text
    if kind in ("image", "audio"):
        return f"[{kind} {part.mime_type}, {_decoded_size(part.data)} bytes]"
    if kind == "resource_link":
        return f"[resource link {part.uri}" + (f" ({part.name})" if part.name else "") + "]"
    if kind == "resource":
        resource = part.resource
        text = getattr(resource, "text", None)
        if text is not None:
            return text
        mime = getattr(resource, "mime_type", None) or "binary"
        return f"[resource {resource.uri}, {mime}, {_decoded_size(getattr(resource, 'blob', ''))} bytes]"
    return f"[{kind} content]"


def _decoded_size(data: str) -> int:
    try:
        return len(base64.b64decode(data, validate=False))
    except (binascii.Error, ValueError):
        return len(data)
