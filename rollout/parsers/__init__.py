"""Tool-call parsers: decoded assistant text -> content + tool calls (hermes, gpt-oss/harmony)."""

from __future__ import annotations

from streamrl.rollout.parsers.base import ParsedTurn, ToolParser, get_parser, register_parser
from streamrl.rollout.parsers.harmony import HarmonyToolParser
from streamrl.rollout.parsers.hermes import HermesToolParser

__all__ = [
    "HarmonyToolParser",
    "HermesToolParser",
    "ParsedTurn",
    "ToolParser",
    "get_parser",
    "register_parser",
]
