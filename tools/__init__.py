"""Tools the agent can call: interface, OpenAI schema, built-ins, YAML loading and the executor."""

from __future__ import annotations

from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.calculator import CalculatorTool, evaluate_expression, format_number
from streamrl.tools.config import load_tool_config
from streamrl.tools.executor import ToolRegistry
from streamrl.tools.schema import OpenAIFunctionToolSchema

__all__ = [
    "BaseTool",
    "CalculatorTool",
    "OpenAIFunctionToolSchema",
    "ToolExecution",
    "ToolRegistry",
    "evaluate_expression",
    "format_number",
    "load_tool_config",
]
