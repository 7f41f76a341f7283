"""Load a YAML tool config into a `ToolRegistry`; accepts our short format and verl's format.

Ours refers to the library's built-in tools by short name, to any other tool class by its import
path, and passes their (validated) config:

    tools:
      - name: calculator
      - class_name: streamrl.workloads.tools.sleep_tool:SleepTool
        config: {latency_s: 0.5, jitter_s: 0.1}

verl's names a class and carries the OpenAI schema (`type: native` is the only kind supported):

    tools:
      - class_name: streamrl.tools.calculator.CalculatorTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calculator, ...}}

A plain function with type hints and a docstring is a tool too (`tools/function.py` generates its
schema); `config` then binds keyword arguments the model never sees, `idempotent` (default false) says
an interrupted call may be re-run, and `instance_id_param` names a parameter that receives the
trajectory id:

    tools:
      - function: streamrl.workloads.tools.examples:word_count
        idempotent: true
      - function: my_pkg.search:search
        name: web_search
        config: {max_results: 5}

The tools of an MCP server (`tools/mcp/`) are one entry that expands to one tool per MCP
tool: the server is started (stdio: `command` + `args`, or `module` run by this interpreter) or
connected to (`url`, streamable HTTP on 127.0.0.1 unless `allow_remote: true`) when the registry is
built, and its `tools/list` gives the schemas. Everything about the server goes inside `mcp:`:

    tools:
      - mcp:
          module: streamrl.workloads.tools.mcp_example_server
          include: [add, echo]        # or exclude: [...]; default: every tool the server lists
          prefix: "demo_"             # the model sees demo_add, demo_echo
          idempotent: [add]           # or true for all; default false
          timeout_s: 10

All may be mixed in one file. An entry with `name` and `class_name` / `function` renames the tool; an
explicit `tool_schema` replaces the default (or generated) one. Classes and functions are imported as
`package.module.attr` or `package.module:attr`; classes must subclass our `BaseTool`. Building a
registry with MCP entries starts their servers in this process: build it where the tools run (the
rollout worker), and close them with `tools.mcp.close_toolsets(registry.tools.values())`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streamrl.core.registry import import_object
from streamrl.tools.base import BaseTool
from streamrl.tools.executor import DEFAULT_MAX_RESULT_CHARS, ToolRegistry
from streamrl.tools.function import FunctionTool
from streamrl.tools.mcp import MCPServerConfig, MCPToolset, close_toolsets  # the SDK loads lazily

# The library's own tools, by name; a workload's tool is named by its `class_name` (configs/tools/sleep.yaml).
BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "streamrl.tools.calculator:CalculatorTool",
}


class ToolEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    class_name: str | None = None
    function: str | None = None  # `package.module:function`, made a tool by FunctionTool
    config: dict[str, Any] = Field(default_factory=dict)
    tool_schema: dict[str, Any] | None = None
    idempotent: bool | None = None  # function entries only; a class declares its own
    instance_id_param: str | None = None  # function entries only
    mcp: dict[str, Any] | None = None  # an MCP server whose tools this entry expands to (MCPServerConfig)

    @model_validator(mode="after")
    def _name_class_or_function(self) -> ToolEntry:
        if self.mcp is not None:
            others = sorted(k for k in self.model_fields_set if k != "mcp")
            if others:
                raise ValueError(
                    f"an `mcp` entry takes no {others}: put include / exclude / prefix / idempotent / timeout_s "
                    "inside `mcp:` (the entry expands to the server's tools)"
                )
            return self
        if self.name is None and self.class_name is None and self.function is None:
            raise ValueError(
                "a tool entry needs `name` (a built-in tool), `class_name` or `function` (or `mcp`: a server's tools)"
            )
        return self

    @property
    def label(self) -> str:
        if self.mcp is not None:
            server = self.mcp.get("url") or self.mcp.get("module") or self.mcp.get("command") or "?"
            return f"mcp {server}"
        return self.name or self.class_name or self.function or "?"


class ToolConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tools: list[ToolEntry] = Field(default_factory=list)
    max_result_chars: int = Field(DEFAULT_MAX_RESULT_CHARS, gt=0)


def _native_config(entry: ToolEntry) -> dict[str, Any]:
    """The entry's config without verl's `type: native` marker (the only kind supported)."""
    config = dict(entry.config)
    kind = config.pop("type", "native")
    if kind != "native":
        raise ValueError(f"tool type {kind!r} is not supported (only 'native')")
    return config


def _build_function_tool(entry: ToolEntry) -> FunctionTool:
    assert entry.function is not None
    if entry.class_name is not None:
        raise ValueError("give either `class_name` (a BaseTool subclass) or `function`, not both")
    fn = import_object(entry.function)
    if isinstance(fn, type) or not callable(fn):
        kind = "a class" if isinstance(fn, type) else f"a {type(fn).__name__}"
        raise ValueError(f"`function: {entry.function}` is {kind}, not a function (classes go under `class_name`)")
    return FunctionTool(
        fn,
        name=entry.name,
        tool_schema=entry.tool_schema,
        idempotent=bool(entry.idempotent),
        bound=_native_config(entry),
        instance_id_param=entry.instance_id_param,
    )


def build_tool(entry: ToolEntry) -> BaseTool:
    if entry.function is not None:
        return _build_function_tool(entry)
    if entry.idempotent is not None or entry.instance_id_param is not None:
        raise ValueError(
            "`idempotent` and `instance_id_param` apply to `function` entries (a tool class declares them)"
        )
    if entry.class_name is not None:
        cls = import_object(entry.class_name)
    elif entry.name in BUILTIN_TOOLS:
        cls = import_object(BUILTIN_TOOLS[entry.name])
    else:
        raise ValueError(
            f"unknown built-in tool {entry.name!r}; built-ins: {sorted(BUILTIN_TOOLS)}, "
            "or give `class_name` or `function`"
        )
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ValueError(f"{entry.class_name} is not a subclass of tools.base.BaseTool")
    tool = cls(config=_native_config(entry), tool_schema=entry.tool_schema)
    if entry.name is not None and entry.name != tool.name:
        tool.schema = tool.schema.with_name(entry.name)
    return tool


def build_mcp_tools(entry: ToolEntry) -> list[BaseTool]:
    """The tools of the entry's MCP server: starts (or connects to) it and lists its tools."""
    assert entry.mcp is not None
    toolset = MCPToolset(MCPServerConfig.model_validate(entry.mcp))
    try:
        return list(toolset.tools())
    except BaseException:
        toolset.close()
        raise


def build_tool_registry(data: Mapping[str, Any], source: str = "<dict>") -> ToolRegistry:
    try:
        parsed = ToolConfigFile.model_validate(dict(data))
    except ValidationError as exc:
        raise ValueError(f"invalid tool config {source}: {exc}") from exc
    tools: list[BaseTool] = []
    try:
        for i, entry in enumerate(parsed.tools):
            try:
                tools.extend(build_mcp_tools(entry) if entry.mcp is not None else [build_tool(entry)])
            except ValueError as exc:  # includes pydantic errors of the tool's config / schema
                raise ValueError(f"{source}: tool #{i} ({entry.label}): {exc}") from exc
        return ToolRegistry(tools, max_result_chars=parsed.max_result_chars)
    except BaseException:
        close_toolsets(tools)  # servers started for earlier entries must not outlive a failed build
        raise


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
