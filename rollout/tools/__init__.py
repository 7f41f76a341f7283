"""Tools the agent can call: interface, OpenAI schema, built-ins, YAML loading and the executor."""

from __future__ import annotations

from rollout.tools.base import BaseTool, ToolExecution
from rollout.tools.calculator import CalculatorTool, evaluate_expression, format_number
from rollout.tools.config import load_tool_config
from rollout.tools.executor import ToolRegistry
from rollout.tools.schema import OpenAIFunctionToolSchema
from rollout.tools.sleep_tool import SleepTool

__all__ = [
    "BaseTool",
    "CalculatorTool",
    "OpenAIFunctionToolSchema",
    "SleepTool",
    "ToolExecution",
    "ToolRegistry",
    "evaluate_expression",
    "format_number",
    "load_tool_config",
]
