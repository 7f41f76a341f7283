"""The two chat wire formats the gateway speaks, OpenAI chat completions and Anthropic messages, and the
one call shape inside (`ChatCall`, `Choice`). The OpenAI Responses API, the third, is `responses.py`.

Owns: validating a request body into a `ChatCall` (messages in the OpenAI chat format the chat template
reads, tools as OpenAI function schemas, sampling parameters), writing an answer back as each API's
response object and as each API's server-sent events, and each API's error body. Anthropic requests are
translated to the same OpenAI-format messages (`tool_use` blocks -> `tool_calls`, `tool_result` blocks ->
`tool` messages), so one session can be driven through either API and compares messages in one form
(`canonical_message`).

Pure functions over dicts: no I/O, no state, nothing to lose in a crash.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

# Status codes the official clients retry (408, 409, 429, >= 500) and do not (400, 401, 404, 410, 413).
RETRYABLE = frozenset({408, 409, 429, 500, 502, 503, 504})

OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    410: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class GatewayError(Exception):
    """An error answered in the caller's API format with `status`; `code` is OpenAI's `error.code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def error_body(api: str, err: GatewayError) -> dict[str, Any]:
    if api == "anthropic":
        kind = ANTHROPIC_ERROR_TYPES.get(err.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = OPENAI_ERROR_TYPES.get(err.status, "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


@dataclass(kw_only=True)
class ChatCall:
    """One chat call, whichever API it came through."""

    api: str  # "openai" | "anthropic" | "responses"
    model: str
    messages: list[dict[str, Any]]  # OpenAI chat format; text content only
    tools: list[dict[str, Any]] | None = None  # OpenAI function tool schemas
    tool_choice: Any = "auto"  # "none" turns tool-call parsing off; others cannot be enforced (no constrained decoding)
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False  # OpenAI `stream_options.include_usage`
    # A Responses-API call (`responses.py`): `messages` are empty until the session resolves its
    # `previous_response_id` against the responses it stored (`responses.conversation`).
    responses: ResponsesInput | None = None


@dataclass(kw_only=True)
class ResponsesInput:
    """What a Responses-API call adds to the chat call: its own input and how it joins stored responses."""

    messages: list[dict[str, Any]]  # this call's `input` as OpenAI chat messages (instructions excluded)
    instructions: str | None = None  # a system message ahead of the whole conversation, this call only
    previous_response_id: str | None = None  # the stored response whose conversation comes first
    store: bool = True  # keep the answer for a later call's `previous_response_id`
    # Echoed in the response object as the request gave them.
    tools: list[dict[str, Any]] = field(default_factory=list)  # Responses-shape function tools
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    top_logprobs: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class ToolCallOut:
    call_id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(kw_only=True)
class Choice:
    """One sampled answer: the decoded content and parsed calls, the engine's tokens and log-probs."""

    content: str
    tool_calls: list[ToolCallOut]
    finish: str  # "stop" | "length"
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # the policy version of each token
    token_texts: list[str]

    def message(self) -> dict[str, Any]:
        """The assistant message in the OpenAI format (what the session expects back next turn)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in self.tool_calls
            ]
        return msg


# ---- requests ------------------------------------------------------------------------------------


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise bad_request(f"'{key}' must be {bound}, got {value!r:.60}", key)
    return value


def _float(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise bad_request(f"'{key}' must be a number in [{lo}, {hi}], got {value!r:.60}", key)
    return float(value)


def _stop(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= 16:
        return list(value)
    raise bad_request(f"'{key}' must be a string or a list of strings", key)


def _text(content: Any, where: str) -> str:
    """Text of an OpenAI content value: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}: only text content parts are supported, got {kind!r}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or a list of text parts", where)


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise bad_request(f"{where}: function.arguments must be a JSON string", where)


def _openai_message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object", where)
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise bad_request(f"{where}.role must be system, developer, user, assistant or tool; got {role!r:.40}", where)
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list", where)
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
                raise bad_request(f"{where}.tool_calls[{j}] needs an id and a function name", where)
            args = _arguments(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}]")
            out["tool_calls"].append(
                {"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}
            )
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"{where}: a tool message needs a tool_call_id", where)
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _openai_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be a function tool with a name", f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        entry = {"name": fn["name"], "description": fn.get("description", ""), "parameters": params}
        out.append({"type": "function", "function": entry})
    return out or None


def parse_openai(body: Any, *, max_choices: int) -> ChatCall:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    choice = body.get("tool_choice", "auto")
    if not (choice in ("none", "auto", "required") or isinstance(choice, dict)):
        raise bad_request("'tool_choice' must be none, auto, required or a function", "tool_choice")
    stream_options = body.get("stream_options") or {}
    return ChatCall(
        api="openai",
        model=model,
        messages=[_openai_message(i, m) for i, m in enumerate(messages)],
        tools=_openai_tools(body.get("tools")),
        tool_choice=choice,
        n=_int(body, "n", 1, max_choices) or 1,
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 0.0, 2.0),
        top_p=_float(body, "top_p", 0.0, 1.0),
        seed=_int(body, "seed", -(2**63)),
        stop=_stop(body.get("stop"), "stop"),
        logprobs=bool(body.get("logprobs")),
        stream=bool(body.get("stream")),
        include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
    )


def _anthropic_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for b in content:
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                kind = b.get("type") if isinstance(b, dict) else type(b).__name__
                raise bad_request(f"{where}: only text blocks are supported here, got {kind!r}")
            parts.append(b["text"])
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or a list of blocks")


def _anthropic_messages(i: int, m: Any) -> list[dict[str, Any]]:
    """One Anthropic message -> OpenAI-format messages (a user turn of tool results becomes tool messages)."""
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}: role must be user or assistant")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad_request(f"{where}.content.{j}: tool_use needs an id and a name")
            args = _arguments(b.get("input", {}), f"{where}.content.{j}")
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
        elif kind == "tool_result" and m["role"] == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad_request(f"{where}.content.{j}: tool_result needs a tool_use_id")
            text = _anthropic_text(b.get("content", ""), f"{where}.content.{j}")
            results.append({"role": "tool", "content": text, "tool_call_id": b["tool_use_id"]})
        else:
            raise bad_request(f"{where}.content.{j}: unsupported block type {kind!r}")
    if m["role"] == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            out["tool_calls"] = calls
        return [out]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def parse_anthropic(body: Any) -> ChatCall:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise bad_request("model: Field required")
    max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None:
        raise bad_request("max_tokens: Field required")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: must be a non-empty list")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _anthropic_text(system, "system")})
    for i, m in enumerate(raw):
        messages.extend(_anthropic_messages(i, m))
    tools = None
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise bad_request("tools: must be a list")
        tools = []
        for i, t in enumerate(body["tools"]):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise bad_request(f"tools.{i}: a tool needs a name")
            schema = t.get("input_schema", {"type": "object", "properties": {}})
            tools.append(
                {
                    "type": "function",
                    "function": {"name": t["name"], "description": t.get("description", ""), "parameters": schema},
                }
            )
        tools = tools or None
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice: type must be auto, any, tool or none")
    return ChatCall(
        api="anthropic",
        model=body["model"],
        messages=messages,
        tools=tools,
        tool_choice="none" if choice["type"] == "none" else "auto",
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 0.0, 1.0),
        top_p=_float(body, "top_p", 0.0, 1.0),
        top_k=_int(body, "top_k", 0),
        stop=_stop(body.get("stop_sequences"), "stop_sequences"),
        stream=bool(body.get("stream")),
    )


def canonical_message(m: dict[str, Any]) -> tuple:
    """A message as compared for "the agent sent back what we answered": role, text, tool calls (id,
    name, arguments as sorted JSON) and tool_call_id. Extra fields a client adds (`refusal`, `name`,
    `annotations`) and None-vs-"" content do not count."""
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", {})
        try:
            args = json.dumps(json.loads(fn.get("arguments") or "{}"), sort_keys=True)
        except (ValueError, TypeError):
            args = fn.get("arguments")
        calls.append((c.get("id"), fn.get("name"), args))
    return (m.get("role"), m.get("content") or "", tuple(calls), m.get("tool_call_id"))


def key_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The request fields that make two calls "the same call": everything but how the answer is
    delivered (`stream`, `stream_options`), so a streamed retry of a plain call gets its answer."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


# ---- responses -----------------------------------------------------------------------------------


def openai_completion(
    completion_id: str, model: str, choices: list[Choice], num_prompt_tokens: int, *, logprobs: bool
) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        finish = "tool_calls" if c.tool_calls else c.finish
        entry: dict[str, Any] = {"index": i, "message": c.message(), "finish_reason": finish, "logprobs": None}
        if logprobs:
            entry["logprobs"] = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(c.token_texts, c.logprobs)
                ]
            }
        out.append(entry)
    num_completion = sum(len(c.token_ids) for c in choices)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt_tokens + num_completion,
        },
    }


def openai_events(completion: dict[str, Any], *, include_usage: bool) -> list[str]:
    """The completion as `chat.completion.chunk` events (one role, content and tool-call chunk per
    choice, then its finish chunk), ending with `[DONE]`."""
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(choices: list[dict], **extra: Any) -> str:
        return f"data: {json.dumps(head | {'choices': choices} | extra)}\n\n"

    events = []
    for c in completion["choices"]:
        i, msg = c["index"], c["message"]
        events.append(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
        if msg.get("content"):
            delta = {"index": i, "delta": {"content": msg["content"]}, "finish_reason": None, "logprobs": c["logprobs"]}
            events.append(chunk([delta]))
        for j, call in enumerate(msg.get("tool_calls") or []):
            delta = {"tool_calls": [{"index": j, "id": call["id"], "type": "function", "function": call["function"]}]}
            events.append(chunk([{"index": i, "delta": delta, "finish_reason": None}]))
        events.append(chunk([{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}]))
    if include_usage:
        events.append(chunk([], usage=completion["usage"]))
    events.append("data: [DONE]\n\n")
    return events


ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens"}


def anthropic_message(message_id: str, model: str, choice: Choice, num_prompt_tokens: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if choice.content:
        content.append({"type": "text", "text": choice.content})
    for c in choice.tool_calls:
        content.append({"type": "tool_use", "id": c.call_id, "name": c.name, "input": c.arguments})
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if choice.tool_calls else ANTHROPIC_STOP[choice.finish],
        "stop_sequence": None,
        "usage": {"input_tokens": num_prompt_tokens, "output_tokens": len(choice.token_ids)},
    }


def anthropic_events(message: dict[str, Any]) -> list[str]:
    """The message as Anthropic's stream: message_start, one block start/delta/stop per content block,
    message_delta with the stop reason, message_stop."""

    def event(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind} | data)}\n\n"

    start = message | {"content": [], "stop_reason": None, "usage": message["usage"] | {"output_tokens": 0}}
    events = [event("message_start", {"message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            events.append(event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}))
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            events.append(event("content_block_start", {"index": i, "content_block": block | {"input": {}}}))
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(event("content_block_delta", {"index": i, "delta": delta}))
        events.append(event("content_block_stop", {"index": i}))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events.append(
        event("message_delta", {"delta": delta, "usage": {"output_tokens": message["usage"]["output_tokens"]}})
    )
    events.append(event("message_stop", {}))
    return events
