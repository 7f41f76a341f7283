"""Load a YAML tool config into a `ToolRegistry`; accepts our short format and verl's format.

Ours refers to built-in tools by short name and passes their (validated) config:

    tools:
      - name: calculator
      - name: sleep
        config: {latency_s: 0.5, jitter_s: 0.1}

verl's names a class and carries the OpenAI schema (`type: native` is the only kind supported):

    tools:
      - class_name: streamrl.rollout.tools.calculator.CalculatorTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calculator, ...}}

Both may be mixed in one file. An entry with both `name` and `class_name` renames the tool. Classes
are imported as `package.module.Class` or `package.module:Class` and must subclass our `BaseTool`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streamrl.rollout.tools.base import BaseTool
from streamrl.rollout.tools.executor import DEFAULT_MAX_RESULT_CHARS, ToolRegistry

BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "streamrl.rollout.tools.calculator:CalculatorTool",
    "sleep": "streamrl.rollout.tools.sleep_tool:SleepTool",
}


class ToolEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    class_name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    tool_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _name_or_class(self) -> ToolEntry:
        if self.name is None and self.class_name is None:
            raise ValueError("a tool entry needs `name` (a built-in tool) or `class_name`")
        return self


class ToolConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tools: list[ToolEntry] = Field(default_factory=list)
    max_result_chars: int = Field(DEFAULT_MAX_RESULT_CHARS, gt=0)


def import_object(path: str) -> Any:
    """Import `package.module:attr` or `package.module.attr`."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path like 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


def build_tool(entry: ToolEntry) -> BaseTool:
    if entry.class_name is not None:
        cls = import_object(entry.class_name)
    elif entry.name in BUILTIN_TOOLS:
        cls = import_object(BUILTIN_TOOLS[entry.name])
    else:
        raise ValueError(f"unknown built-in tool {entry.name!r}; built-ins: {sorted(BUILTIN_TOOLS)}, or give `class_name`")
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ValueError(f"{entry.class_name} is not a subclass of rollout.tools.base.BaseTool")
    config = dict(entry.config)
    kind = config.pop("type", "native")
    if kind != "native":
        raise ValueError(f"tool type {kind!r} is not supported (only 'native')")
    tool = cls(config=config, tool_schema=entry.tool_schema)
    if entry.name is not None and entry.name != tool.name:
        tool.schema = tool.schema.with_name(entry.name)
    return tool


def build_tool_registry(data: Mapping[str, Any], source: str = "<dict>") -> ToolRegistry:
    try:
        parsed = ToolConfigFile.model_validate(dict(data))
    except ValidationError as exc:
        raise ValueError(f"invalid tool config {source}: {exc}") from exc
    tools = []
    for i, entry in enumerate(parsed.tools):
        try:
            tools.append(build_tool(entry))
        except ValueError as exc:  # includes pydantic errors of the tool's config / schema
            label = entry.name or entry.class_name
            raise ValueError(f"{source}: tool #{i} ({label}): {exc}") from exc
    return ToolRegistry(tools, max_result_chars=parsed.max_result_chars)


def load_tool_config(source: str | Path | Mapping[str, Any]) -> ToolRegistry:
    """A registry from a YAML file path or an already-loaded mapping."""
    if isinstance(source, Mapping):
        return build_tool_registry(source)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"tool config {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"tool config {path} must be a mapping with a `tools` list")
    return build_tool_registry(data, str(path))
