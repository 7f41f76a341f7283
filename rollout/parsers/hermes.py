"""Hermes tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

This is the format of our ChatML tool template (models/chatml_tools.jinja) and of Qwen2.5 /
Hermes models. Everything outside the blocks is the turn's `content`. Malformed blocks (bad JSON, no
name, non-object arguments, a `<tool_call>` never closed) become error calls whose message tells the
model what the expected shape is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from streamrl.rollout.parsers.base import (
    ParsedTurn,
    ToolParser,
    call_id_for,
    load_json,
    make_error_call,
    register_parser,
)
from streamrl.tools.types import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
EXPECTED_SHAPE = '<tool_call>{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}</tool_call>'

_NAME_GUESS = re.compile(r'"name"\s*:\s*"([^"\\]{1,128})"')
# End-of-turn markers that appear when a turn is decoded with special tokens kept.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|endoftext|>")


def _guess_name(body: str) -> str:
    match = _NAME_GUESS.search(body)
    return match.group(1) if match else ""


def parse_call_body(body: str, index: int) -> ToolCall:
    """Parse the JSON between the tags into a ToolCall (an error call on any defect)."""
    stripped = body.strip()
    if not stripped:
        return make_error_call(index, f"empty tool call; expected {EXPECTED_SHAPE}")
    obj, problem = load_json(stripped)
    if problem is not None:
        return make_error_call(
            index, f"tool call is not valid JSON ({problem}); expected {EXPECTED_SHAPE}", _guess_name(stripped)
        )
    if not isinstance(obj, dict):
        return make_error_call(
            index, f"tool call must be a JSON object, got {type(obj).__name__}; expected {EXPECTED_SHAPE}"
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return make_error_call(index, f'tool call has no "name" string; expected {EXPECTED_SHAPE}')
    name = name.strip()
    # "parameters" is a common alias emitted by models trained on other templates.
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        arguments, problem = load_json(arguments) if arguments.strip() else ({}, None)
        if problem is not None:
            return make_error_call(
                index, f'"arguments" of {name!r} is a string that is not valid JSON; pass a JSON object', name
            )
    if not isinstance(arguments, dict):
        return make_error_call(
            index, f'"arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}', name
        )
    return ToolCall(call_id=call_id_for(index), name=name, arguments=arguments)


@register_parser("hermes")
class HermesToolParser(ToolParser):
    def parse(self, text: str) -> ParsedTurn:
        text = text.rstrip()
        while text.endswith(END_OF_TURN_MARKERS):
            marker = next(m for m in END_OF_TURN_MARKERS if text.endswith(m))
            text = text[: -len(marker)].rstrip()
        calls: list[ToolCall] = []
        content_parts: list[str] = []
        pos = 0
        while True:
            start = text.find(OPEN_TAG, pos)
            if start < 0:
                content_parts.append(text[pos:])
                break
            content_parts.append(text[pos:start])
            body_start = start + len(OPEN_TAG)
            end = text.find(CLOSE_TAG, body_start)
            nested = text.find(OPEN_TAG, body_start)
            if end < 0 or (0 <= nested < end):
                # Unclosed: the block runs to the next <tool_call> or the end of the text.
                stop = nested if nested >= 0 else len(text)
                body = text[body_start:stop]
                guess = parse_call_body(body, len(calls))
                calls.append(
                    make_error_call(
                        len(calls),
                        f"unclosed {OPEN_TAG} tag: end every call with {CLOSE_TAG}; expected {EXPECTED_SHAPE}",
                        guess.name,
                        guess.arguments,
                    )
                )
                pos = stop
                continue
            calls.append(parse_call_body(text[body_start:end], len(calls)))
            pos = end + len(CLOSE_TAG)
        content = "".join(content_parts).strip()
        return ParsedTurn(content=content, tool_calls=calls, num_errors=sum(c.error is not None for c in calls))

    def render(self, content: str, calls: Iterable[ToolCall]) -> str:
        """Same layout as the chat template: content, then one block per call, newline-separated."""
        parts = [content] if content else []
        for call in calls:
            payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
            parts.append(f"{OPEN_TAG}\n{payload}\n{CLOSE_TAG}")
        return "\n".join(parts)
