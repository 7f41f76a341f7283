"""The gateway through the official `openai` and `anthropic` SDKs against the real server on
127.0.0.1: plain calls, a tool-calling round trip, streaming, `n > 1`, and the error statuses and
bodies each SDK acts on (400 and 401 in each API's own format, 404, 410, 413)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.rollout.gateway.conftest import ANTHROPIC_CALC_TOOL, CALC_TOOL
from tests.rollout.test_agent_loop import ANSWER, CALL

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "What is 12 times 7?"}]


async def test_openai_plain_call_and_models(make_gateway):
    gw = await make_gateway([ANSWER])
    client = gw.openai()
    models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    out = await client.chat.completions.create(model="anything", messages=USER)
    assert out.choices[0].message.content == ANSWER
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
    assert out.usage.prompt_tokens == len(gw.data.prompt_ids) and out.usage.completion_tokens > 0


async def test_openai_tool_calling_round_trip(make_gateway, tiny_tokenizer):
    gw = await make_gateway([CALL, ANSWER])
    client = gw.openai()
    first = await client.chat.completions.create(model="policy", messages=USER, tools=[CALC_TOOL])
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12 * 7"}
    history = [*USER, msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "84"}]
    second = await client.chat.completions.create(model="policy", messages=history, tools=[CALC_TOOL])
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    assert gw.session.state.num_forks == 0  # one sequence
    tool_msg = {"role": "tool", "tool_call_id": call.id, "content": "84"}
    obs = gw.ctx.encoder.encode_new_messages([tool_msg])
    gw.session.finish()
    n0 = len(tiny_tokenizer.encode(CALL, add_special_tokens=False)) + 1
    assert gw.data.response_mask == [1] * n0 + [0] * len(obs) + [1] * (len(gw.data.response_ids) - n0 - len(obs))
    assert gw.data.response_ids[n0 : n0 + len(obs)] == obs


async def test_openai_streaming_content_and_tool_calls(make_gateway):
    gw = await make_gateway([CALL, ANSWER])
    client = gw.openai()
    stream = await client.chat.completions.create(
        model="policy", messages=USER, tools=[CALC_TOOL], stream=True, stream_options={"include_usage": True}
    )
    calls, finish, usage = [], None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["calculator"]
    assert usage is not None and usage.completion_tokens > 0
    history = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [c.model_dump(exclude={"index"}) for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "84"},
    ]
    stream = await client.chat.completions.create(model="policy", messages=history, tools=[CALC_TOOL], stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == ANSWER and gw.session.state.num_forks == 0


async def test_openai_n_choices_and_the_one_continued_joins_the_record(make_gateway, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    answers = ["The answer is 80.", "The answer is 84.", "The answer is 90."]
    script = [tiny_tokenizer.encode(a, add_special_tokens=False) + [eos] for a in answers]
    gw = await make_gateway(script=script)
    client = gw.openai()
    out = await client.chat.completions.create(model="policy", messages=USER, n=3, logprobs=True)
    assert sorted(c.message.content for c in out.choices) == sorted(answers)
    chosen = out.choices[1].message
    assert len(out.choices[1].logprobs.content) == len(script[1])
    nxt = [*USER, {"role": "assistant", "content": chosen.content}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="policy", messages=nxt)
    state = gw.session.state
    assert state.num_unused_choices == 2 and state.num_forks == 0
    sampled = [t for t, m in zip(gw.data.response_ids, gw.data.response_mask) if m]
    chosen_ids = tiny_tokenizer.encode(chosen.content, add_special_tokens=False) + [eos]
    assert sampled == chosen_ids  # the continued choice, not choice 0


async def test_anthropic_tool_use_round_trip_and_streaming(make_gateway):
    gw = await make_gateway([CALL, ANSWER])
    client = gw.anthropic()
    first = await client.messages.create(model="policy", max_tokens=100, messages=USER, tools=[ANTHROPIC_CALC_TOOL])
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "calculator" and use.input == {"expression": "12 * 7"}
    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "84"}]},
    ]
    async with client.messages.stream(
        model="policy", max_tokens=100, messages=history, tools=[ANTHROPIC_CALC_TOOL]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == ANSWER and final.stop_reason == "end_turn"
    assert gw.session.state.num_forks == 0 and gw.session.state.num_calls == 2


async def test_bad_requests_get_400_in_each_api_format(make_gateway):
    gw = await make_gateway([ANSWER])
    with pytest.raises(openai.BadRequestError) as err:
        await gw.openai().chat.completions.create(model="policy", messages=USER, n=0)
    assert err.value.status_code == 400
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["param"] == "n"
    with pytest.raises(anthropic.BadRequestError) as aerr:
        await gw.anthropic().messages.create(
            model="policy", max_tokens=10, messages=[{"role": "robot", "content": "hi"}]
        )
    assert aerr.value.status_code == 400
    assert aerr.value.response.json()["type"] == "error"
    assert aerr.value.response.json()["error"]["type"] == "invalid_request_error"
    assert gw.engine.requests_seen == [] and gw.session.state.num_calls == 0


async def test_missing_or_wrong_token_gets_401(make_gateway):
    gw = await make_gateway([ANSWER])
    with pytest.raises(openai.AuthenticationError):
        await gw.openai(api_key="wrong").chat.completions.create(model="policy", messages=USER)
    with pytest.raises(anthropic.AuthenticationError) as err:
        await gw.anthropic(api_key="wrong").messages.create(model="policy", max_tokens=10, messages=USER)
    assert err.value.response.json()["error"]["type"] == "authentication_error"
    async with httpx.AsyncClient() as http:
        r = await http.post(gw.base_url + "/chat/completions", json={"model": "p", "messages": USER})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["x-should-retry"] == "false"
    assert gw.engine.requests_seen == []


async def test_unknown_session_stale_attempt_and_oversized_body(make_gateway):
    gw = await make_gateway([ANSWER], gateway={"max_request_bytes": 2000})
    auth = {"authorization": f"Bearer {gw.api_key}"}
    root = f"http://127.0.0.1:{gw.server.port}/s"
    body = {"model": "p", "messages": USER}
    async with httpx.AsyncClient(headers=auth) as http:
        assert (await http.post(f"{root}/nope/0/v1/chat/completions", json=body)).status_code == 404
        gw.session.state.attempt = 1  # a resume moved the session on: attempt 0's calls are late
        r = await http.post(f"{root}/{gw.session.session_id}/0/v1/chat/completions", json=body)
        assert r.status_code == 410 and r.json()["error"]["code"] == "stale_attempt"
        big = {"model": "p", "messages": [{"role": "user", "content": "x" * 5000}]}
        r = await http.post(f"{root}/{gw.session.session_id}/1/v1/messages", json=big | {"max_tokens": 5})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert gw.engine.requests_seen == []


# Bodies no retry can fix, as raw bytes: the SDKs would refuse to send them. The first two nest past the
# JSON parser's recursion limit and past the gateway's own; the others hold lone surrogates, escaped
# or as raw UTF-8 bytes (the parser passes those through), in a value and in a key.
UNFIXABLE = {
    "deep": (b'{"model":"p","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeper than 128 levels"),
    "deep_tools": (
        b'{"model":"p","messages":[{"role":"user","content":"hi"}],"tools":' + b"[" * 500 + b"]" * 500 + b"}",
        "deeper than 128 levels",
    ),
    "surrogate": (b'{"model":"p","messages":[{"role":"user","content":"hi \\ud800"}]}', "messages[0].content"),
    "surrogate_bytes": (b'{"model":"p","messages":[{"role":"user","content":"hi \xed\xb0\x80"}]}', "U+DC00"),
    "surrogate_key": (b'{"model":"p","messages":[{"role":"user","content":"hi"}],"metadata":{"\\udfff":1}}', "a key"),
}


@pytest.mark.parametrize("api", ["chat/completions", "messages"])
async def test_deep_json_and_lone_surrogates_get_a_final_400_not_a_retried_500(make_gateway, api):
    gw = await make_gateway([ANSWER])
    headers = {"authorization": f"Bearer {gw.api_key}", "content-type": "application/json"}
    async with httpx.AsyncClient(headers=headers, timeout=30) as http:
        for name, (body, says) in UNFIXABLE.items():
            if api == "messages":
                body = body[:-1] + b',"max_tokens":5}'
            r = await http.post(f"{gw.base_url}/{api}", content=body)
            assert r.status_code == 400, f"{name}: {r.status_code} {r.text[:200]}"
            assert r.headers["x-should-retry"] == "false"
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and says in error["message"], f"{name}: {error}"
        fine = b'{"model":"p","messages":[{"role":"user","content":"hi \\ud83d\\ude00"}],"max_tokens":5}'
        assert (await http.post(f"{gw.base_url}/{api}", content=fine)).status_code == 200  # a whole pair
    assert gw.session.state.num_calls == 1
