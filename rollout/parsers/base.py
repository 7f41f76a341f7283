"""Tool-call parser interface and parser registry.

An agent loop decodes one assistant turn to text and hands it to a `ToolParser`, which splits it into
the visible `content` and a list of `ToolCall`s. Parsers never raise on model output: a malformed call
becomes a `ToolCall` with `error` set (and the best-guess name, or ""), so the loop can answer it with
an error observation the model can learn from. `tools.schema.validate_call` then checks a well-formed call against
the OpenAI function schemas of the registered tools (unknown tool, missing required arguments, wrong
JSON types) before anything is executed.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from streamrl.core.registry import Registry
from streamrl.tools.types import ToolCall


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
