"""gpt-oss "harmony" format parser, written against the text form of the format (no openai_harmony,
which downloads its encodings at import time).

A harmony completion is a sequence of messages

    <|start|>assistant<|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>answer<|return|>

where the leading `<|start|>assistant` of the first message is usually part of the prompt. The
recipient `to=functions.NAME` may also sit in the role part (`<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`). A message addressed to `functions.*` is a tool call whose body
is the JSON arguments. `content` is the final channel (or, without one, commentary messages that
address no tool); analysis text is chain of thought and never content. A call cut off before its
`<|call|>` is accepted when its JSON is complete, because `<|call|>` is a stop token that decoders
often drop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from streamrl.rollout.parsers.base import (
    ParsedTurn,
    ToolParser,
    call_id_for,
    load_json,
    make_error_call,
    register_parser,
)
from streamrl.tools.types import ToolCall

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
FUNCTIONS_PREFIX = "functions."

_TERMINATOR = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")
EXPECTED_SHAPE = (
    "<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{JSON arguments}<|call|>"
)


@dataclass(kw_only=True, slots=True)
class HarmonyMessage:
    role: str
    channel: str
    recipient: str | None
    body: str
    terminator: str | None  # None when the text ended inside the message


def _parse_header(header: str) -> tuple[str, str, str | None]:
    """(role, channel, recipient) of the text between a message start and `<|message|>`."""
    header = header.replace(START, "")
    recipient_match = _RECIPIENT.search(header)
    recipient = recipient_match.group(1) if recipient_match else None
    role_part, _, channel_part = header.partition(CHANNEL)
    role_words = [w for w in role_part.split() if not w.startswith("to=")]
    role = role_words[0] if role_words else "assistant"
    channel_part = channel_part.partition(CONSTRAIN)[0]
    channel_words = [w for w in channel_part.split() if not w.startswith("to=")]
    channel = channel_words[0] if channel_words else ""
    return role, channel, recipient


def split_messages(text: str) -> tuple[list[HarmonyMessage], str]:
    """All messages in `text`, plus any trailing text that never reached a `<|message|>`."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while True:
        marker = text.find(MESSAGE, pos)
        if marker < 0:
            return messages, text[pos:]
        header = text[pos:marker]
        body_start = marker + len(MESSAGE)
        term = _TERMINATOR.search(text, body_start)
        if term is None:
            body, terminator, pos = text[body_start:], None, len(text)
        elif term.group() == START:
            body, terminator, pos = text[body_start : term.start()], None, term.start()
        else:
            body, terminator, pos = text[body_start : term.start()], term.group(), term.end()
        role, channel, recipient = _parse_header(header)
        messages.append(
            HarmonyMessage(role=role, channel=channel, recipient=recipient, body=body, terminator=terminator)
        )


def _to_call(msg: HarmonyMessage, index: int) -> ToolCall:
    assert msg.recipient is not None
    name = msg.recipient.removeprefix(FUNCTIONS_PREFIX)
    body = msg.body.strip()
    arguments, problem = load_json(body) if body else ({}, None)
    if problem is not None:
        hint = "" if msg.terminator else " (the message was not terminated by <|call|>)"
        return make_error_call(
            index, f"arguments of {name!r} are not valid JSON ({problem}){hint}; expected {EXPECTED_SHAPE}", name
        )
    if not isinstance(arguments, dict):
        return make_error_call(
            index, f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}", name
        )
    if msg.terminator not in (CALL, None):
        return make_error_call(
            index, f"tool call to {name!r} must end with <|call|>, got {msg.terminator}", name, arguments
        )
    if not name:
        return make_error_call(index, f"tool call has an empty recipient; expected {EXPECTED_SHAPE}")
    return ToolCall(call_id=call_id_for(index), name=name, arguments=arguments)


@register_parser("gpt-oss")
class HarmonyToolParser(ToolParser):
    def parse(self, text: str) -> ParsedTurn:
        messages, _trailing = split_messages(text)
        if not messages:
            # Plain text without harmony structure: all of it is content.
            return ParsedTurn(content=_SPECIAL.sub("", text).strip())
        calls: list[ToolCall] = []
        final: list[str] = []
        commentary: list[str] = []
        for msg in messages:
            if msg.recipient is not None and msg.role == "assistant":
                calls.append(_to_call(msg, len(calls)))
            elif msg.channel == "final":
                final.append(msg.body.strip())
            elif msg.channel == "commentary" and msg.recipient is None:
                commentary.append(msg.body.strip())
        content = "\n".join(p for p in (final or commentary) if p)
        return ParsedTurn(content=content, tool_calls=calls, num_errors=sum(c.error is not None for c in calls))

    def render(self, content: str, calls: Iterable[ToolCall]) -> str:
        parts = []
        for call in calls:
            args = json.dumps(call.arguments, ensure_ascii=False)
            parts.append(
                f"{START}assistant{CHANNEL}commentary to={FUNCTIONS_PREFIX}{call.name} "
                f"{CONSTRAIN}json{MESSAGE}{args}{CALL}"
            )
        if content:
            parts.append(f"{START}assistant{CHANNEL}final{MESSAGE}{content}{RETURN}")
        return "".join(parts)


# Alias: configs may say either name.
register_parser("harmony")(HarmonyToolParser)
