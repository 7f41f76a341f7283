"""The OpenAI Responses API (`POST /v1/responses`) on a gateway session.

Owns the third wire format: validating a Responses request into the gateway's one call shape
(`protocol.ChatCall` with its `ResponsesInput`), resolving `previous_response_id` against the responses
a session stored (`conversation`, `link`), and writing the answer back as a `response` object and as
the Responses server-sent events (`events`).

A Responses call is a chat call underneath: its input items become OpenAI chat messages (a `message`
item a message; `function_call` items the tool calls of the assistant message before them, or of a new
one; `function_call_output` items tool messages), its function tools chat tool schemas, and its output
is the sampled choice's assistant message as items again. So it is placed on the session's token
record, sampled, journaled, interrupted by weight syncs and replayed exactly as a chat completion is
(`session.py`), and one session may mix the APIs.

Stored responses: with `store` (the default) the answer's journal entry carries a `journal.ResponseLink`,
and a later call naming it as `previous_response_id` continues its conversation (its input, then its
output, then the new input; `instructions` are the new call's own, the API does not carry them over).
The links are part of the journal records, so a resumed attempt folds them back with the answers and a
restarted program can chain onto a response of an earlier attempt.

Pure functions over dicts and the session's stored entries: no I/O, no state.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Mapping
from typing import Any

from streamrl.rollout.gateway import journal, protocol
from streamrl.rollout.gateway.journal import JournalEntry, ResponseLink
from streamrl.rollout.gateway.protocol import ChatCall, Choice, GatewayError, ResponsesInput, bad_request

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text")


# ---- requests ------------------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    """Text of a message's content (or a function_call_output's output): a string or text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"{where}[{j}]: only input_text and output_text parts are supported, got {kind!r:.40}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where} must be a string or a list of content parts", where)


def input_messages(items: Any, where: str = "input") -> list[dict[str, Any]]:
    """Responses input items (or a response's output items) as OpenAI chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request(f"'{where}' must be a string or a list of input items", where)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"{at}.role must be system, developer, user or assistant; got {role!r:.40}", at)
            out.append({"role": role, "content": _content_text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise bad_request(f"{at}: a function_call needs a call_id and a name", at)
            args = protocol._arguments(item.get("arguments", "{}"), at)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{at}: a function_call_output needs a call_id", at)
            content = _content_text(item.get("output"), f"{at}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        else:
            raise bad_request(
                f"{at}: input items of type {kind!r:.40} are not supported here "
                "(message, function_call and function_call_output are)",
                at,
            )
    return out


def _tools(tools: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """(chat tool schemas or None, the Responses-shape tools to echo). Only function tools: the gateway
    samples the policy and runs no tool itself."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    chat, echo = [], []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: {kind!r:.40} tools are not served: the gateway samples the policy and runs no tool "
                "itself, built-in ones (web_search, file_search, code_interpreter, ...) included; declare the tool "
                "as a function and run it in the agent",
                f"tools[{i}]",
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}]: a function tool needs a name", f"tools[{i}]")
        params = t.get("parameters") or {"type": "object", "properties": {}}
        description = t.get("description") or ""
        chat.append(
            {"type": "function", "function": {"name": t["name"], "description": description, "parameters": params}}
        )
        echo.append(
            {
                "type": "function",
                "name": t["name"],
                "description": description,
                "parameters": params,
                "strict": t.get("strict"),
            }
        )
    return chat or None, echo


def _refuse_unserved(body: dict[str, Any]) -> None:
    """Request fields the gateway cannot honour, refused rather than silently dropped."""
    if body.get("background"):
        raise bad_request(
            "'background' responses are not served: every call is answered in its own request", "background"
        )
    if body.get("conversation") is not None:
        raise bad_request(
            "'conversation' (the Conversations API) is not served: chain calls with previous_response_id",
            "conversation",
        )
    if body.get("prompt") is not None:
        raise bad_request("'prompt' (stored prompt templates) is not served: send input and instructions", "prompt")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise bad_request(
            f"text.format {fmt.get('type')!r:.40} cannot be enforced (no constrained decoding): ask for the format in "
            "the instructions and parse the text in the agent",
            "text.format",
        )


def parse(body: Any) -> ChatCall:
    """A `POST /v1/responses` body as a chat call; its messages are filled in by the session (`conversation`)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise bad_request("'model' must be a string", "model")
    _refuse_unserved(body)
    messages = input_messages(body.get("input"))
    if not messages:
        raise bad_request("'input' must be a non-empty string or list of items", "input")
    for key in ("instructions", "previous_response_id"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise bad_request(f"'{key}' must be a string", key)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("'store' must be a boolean", "store")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad_request("'include' must be a list of strings", "include")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object", "metadata")
    choice = body.get("tool_choice") or "auto"
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
    if not (choice in ("none", "auto", "required") or named):
        raise bad_request(
            "'tool_choice' must be none, auto, required or a function ({type: function, name})", "tool_choice"
        )
    chat_tools, tools = _tools(body.get("tools"))
    top_logprobs = protocol._int(body, "top_logprobs", 0, 20)
    return ChatCall(
        api="responses",
        model=body["model"],
        messages=[],
        tools=chat_tools,
        tool_choice=choice,
        max_tokens=protocol._int(body, "max_output_tokens", 1),
        temperature=protocol._float(body, "temperature", 0.0, 2.0),
        top_p=protocol._float(body, "top_p", 0.0, 1.0),
        logprobs=LOGPROBS_INCLUDE in include or top_logprobs is not None,
        stream=bool(body.get("stream")),
        responses=ResponsesInput(
            messages=messages,
            instructions=body.get("instructions"),
            previous_response_id=body.get("previous_response_id"),
            store=store is not False,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=body.get("parallel_tool_calls") is not False,
            top_logprobs=top_logprobs,
            metadata=metadata,
        ),
    )


# ---- stored responses ----------------------------------------------------------------------------


def history(stored: Mapping[str, JournalEntry], response_id: str) -> list[dict[str, Any]]:
    """The conversation stored response `response_id` ended: the input of its chain (instructions
    excluded) and its output, as chat messages."""
    chain: list[JournalEntry] = []
    at: str | None = response_id
    while at is not None:
        entry = stored[at]
        assert entry.link is not None, f"response {at} is not stored"
        chain.append(entry)
        at = entry.link.previous
    out: list[dict[str, Any]] = []
    for entry in reversed(chain):
        assert entry.link is not None
        out += entry.link.messages
        out += input_messages(entry.response["output"], "output")
    return out


def conversation(stored: Mapping[str, JournalEntry], request: ResponsesInput) -> list[dict[str, Any]]:
    """The chat messages a call samples after: its instructions, the conversation of the response it
    names (400 `previous_response_not_found` if the session stored none by that id), its own input."""
    head = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
    previous = request.previous_response_id
    if previous is None:
        return head + request.messages
    if previous not in stored:
        raise GatewayError(
            400,
            f"Previous response with id {previous!r} not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return head + history(stored, previous) + request.messages


def link(stored: dict[str, JournalEntry], request: ResponsesInput) -> ResponseLink | None:
    """How an answer to `request` is stored (None with `store: false`). A call that sends its whole
    conversation again (no previous_response_id) is linked to the last stored response when its input
    begins with that one's conversation, so its record holds only the new input."""
    if not request.store:
        return None
    if request.previous_response_id is not None:
        return ResponseLink(previous=request.previous_response_id, messages=request.messages)
    if stored:
        last = next(reversed(stored))
        before = [protocol.canonical_message(m) for m in history(stored, last)]
        if journal.common_prefix(before, request.messages) == len(before):
            return ResponseLink(previous=last, messages=request.messages[len(before) :])
    return ResponseLink(messages=request.messages)


# ---- responses -----------------------------------------------------------------------------------


def response_object(response_id: str, call: ChatCall, choice: Choice, num_prompt_tokens: int) -> dict[str, Any]:
    """The `response` object of a sampled choice: a `message` item with its text (unless the turn is
    only tool calls), then one `function_call` item per parsed call."""
    request = call.responses
    assert request is not None, "a Responses answer of a call that is not one"
    status = "incomplete" if choice.finish == "length" else "completed"
    output: list[dict[str, Any]] = []
    if choice.content or not choice.tool_calls:
        logprobs = [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(choice.token_texts, choice.logprobs)
        ]
        part = {"type": "output_text", "text": choice.content, "annotations": [], "logprobs": logprobs}
        item_id = "msg_" + response_id.removeprefix("resp_")
        output.append({"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]})
    for c in choice.tool_calls:
        output.append(
            {
                "id": "fc_" + c.call_id.removeprefix("call_"),
                "type": "function_call",
                "call_id": c.call_id,
                "name": c.name,
                "arguments": c.arguments_json,
                "status": "completed",
            }
        )
    num_output = len(choice.token_ids)
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": call.max_tokens,
        "model": call.model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": call.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": request.tool_choice,
        "tools": request.tools,
        "top_logprobs": request.top_logprobs,
        "top_p": call.top_p,
        "truncation": "disabled",
        "usage": {
            "input_tokens": num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt_tokens + num_output,
        },
        "user": None,
        "metadata": request.metadata,
    }


def events(response: dict[str, Any]) -> list[str]:
    """The response as the Responses stream: created, in_progress; per output item its added event, its
    text part (part added, one text delta, text done, part done) or its arguments (one delta, done), its
    done event; then completed (incomplete when it stopped at the token limit). Rendered from the whole
    answer, so the deltas are exactly its text and arguments."""
    seq = itertools.count()

    def event(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq)} | data)}\n\n"

    start = response | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    out = [event("response.created", response=start), event("response.in_progress", response=start)]
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            out.append(
                event(
                    "response.output_item.added", output_index=i, item=item | {"status": "in_progress", "content": []}
                )
            )
            for j, part in enumerate(item["content"]):
                at = {"item_id": item["id"], "output_index": i, "content_index": j}
                out.append(event("response.content_part.added", **at, part=part | {"text": "", "logprobs": []}))
                if part["text"]:
                    out.append(event("response.output_text.delta", **at, delta=part["text"], logprobs=part["logprobs"]))
                out.append(event("response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"]))
                out.append(event("response.content_part.done", **at, part=part))
        else:
            out.append(
                event(
                    "response.output_item.added", output_index=i, item=item | {"status": "in_progress", "arguments": ""}
                )
            )
            at = {"item_id": item["id"], "output_index": i}
            out.append(event("response.function_call_arguments.delta", **at, delta=item["arguments"]))
            out.append(
                event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
            )
        out.append(event("response.output_item.done", output_index=i, item=item))
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    out.append(event(final, response=response))
    return out
