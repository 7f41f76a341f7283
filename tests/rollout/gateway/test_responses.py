"""The OpenAI Responses API (`/v1/responses`) through the official `openai` SDK against the real server on
127.0.0.1 with a scripted engine: a plain response; a function call round trip, chained by
`previous_response_id` or sent whole again, which leaves exactly the record the same conversation makes
through chat completions; streaming, whose text is the record's sampled tokens decoded, token for
token, with the tool-call markup left out as the plain response leaves it out; refusals (an unknown or
unstored previous response, built-in tools); a restarted program replayed from the journal; a weight
sync mid-call; journal records that do not grow with the conversation; the Agents SDK's default
(Responses) model."""

from __future__ import annotations

import asyncio
import json
import statistics

import httpx
import openai
import pytest

from streamrl.engines.fake import FakeEngine, fake_logprob
from streamrl.rollout.gateway import responses
from streamrl.rollout.gateway.journal import CallRecord
from streamrl.rollout.gateway.session import CallStats, Session, call_key
from streamrl.rollout.types import AgentState
from tests.rollout.gateway.conftest import CALC_TOOL, gateway_ctx, new_data
from tests.rollout.gateway.test_session import LONG, sampled_runs
from tests.rollout.test_agent_loop import ANSWER, CALL

pytestmark = pytest.mark.timeout(60)

QUESTION = "What is 12 times 7?"
USER = [{"role": "user", "content": QUESTION}]
TOOL = {"type": "function", **CALC_TOOL["function"]}  # the Responses shape: no "function" wrapper
LOGPROBS = ["message.output_text.logprobs"]


def _record(data) -> tuple:
    return (data.prompt_ids, data.response_ids, data.response_mask, data.behavior_logprobs, data.policy_versions)


async def test_a_plain_response_is_the_records_sample(make_gateway, tiny_tokenizer):
    gw = await make_gateway([ANSWER], policy_version=3)
    client = gw.openai()
    out = await client.responses.create(model="policy", input=QUESTION, include=LOGPROBS)
    assert out.object == "response" and out.id.startswith("resp_") and out.status == "completed"
    assert out.output_text == ANSWER
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant"
    assert gw.data.prompt_ids == gw.ctx.encoder.encode_prompt(USER, None)
    sampled = gw.session.state.branches[0].token_ids
    assert sampled == tiny_tokenizer.encode(ANSWER, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    assert (out.usage.input_tokens, out.usage.output_tokens) == (len(gw.data.prompt_ids), len(sampled))
    lps = item.content[0].logprobs
    assert [lp.logprob for lp in lps] == [fake_logprob(len(gw.data.prompt_ids) + i, t) for i, t in enumerate(sampled)]
    assert (await client.responses.retrieve(out.id)).output_text == ANSWER  # stored (the default)


async def test_instructions_come_first_and_are_not_carried_over(make_gateway):
    gw = await make_gateway(["The answer is 84.", "Yes."])
    client = gw.openai()
    first = await client.responses.create(model="p", input=QUESTION, instructions="Be brief.")
    system = {"role": "system", "content": "Be brief."}
    assert gw.data.prompt_ids == gw.ctx.encoder.encode_prompt([system, *USER], None)
    await client.responses.create(model="p", input="Sure?", previous_response_id=first.id, instructions="Be brief.")
    assert gw.session.state.num_forks == 0  # same instructions: the record is extended
    await client.responses.create(model="p", input="Sure?", previous_response_id=first.id)
    # Without them the conversation no longer begins with the system message: a rewrite of the history.
    assert gw.data.messages[0] == USER[0] and gw.session.state.num_forks == 1


async def _chat_round_trip(gw) -> None:
    client = gw.openai()
    first = await client.chat.completions.create(model="p", messages=USER, tools=[CALC_TOOL])
    msg = first.choices[0].message
    tool = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "84"}
    await client.chat.completions.create(
        model="p", messages=[*USER, msg.model_dump(exclude_none=True), tool], tools=[CALC_TOOL]
    )


@pytest.mark.parametrize("chained", [True, False], ids=["previous_response_id", "whole_input_again"])
async def test_a_function_call_round_trip_leaves_the_record_chat_completions_leave(make_gateway, chained):
    gw = await make_gateway([CALL, ANSWER], policy_version=2)
    client = gw.openai()
    first = await client.responses.create(model="p", input=QUESTION, tools=[TOOL])
    (call,) = first.output  # a turn of only a tool call has no message item
    assert call.type == "function_call" and call.name == "calculator" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"expression": "12 * 7"} and first.output_text == ""
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "84"}
    if chained:
        second = await client.responses.create(model="p", input=[result], previous_response_id=first.id, tools=[TOOL])
    else:  # as the Agents SDK does: the earlier input, the output items as they came, the new items
        items = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output]]
        second = await client.responses.create(model="p", input=[*items, result], tools=[TOOL])
    assert second.output_text == ANSWER and second.status == "completed"
    assert second.previous_response_id == (first.id if chained else None)
    assert gw.session.state.num_forks == 0 and gw.session.state.num_calls == 2
    gw.session.finish()
    assert [m["role"] for m in gw.data.messages] == ["user", "assistant", "tool", "assistant"]
    # The same conversation through chat completions, on a fresh session: the same tokens, masks,
    # log-probs and versions, so the record's exactness is the chat endpoint's.
    chat = await make_gateway([CALL, ANSWER], policy_version=2)
    await _chat_round_trip(chat)
    chat.session.finish()
    assert _record(gw.data) == _record(chat.data) and 0 in gw.data.response_mask


async def test_a_rewritten_history_forks_and_keeps_the_budget(make_gateway, tiny_tokenizer):
    gw = await make_gateway(["The answer is 84.", "Fine."])
    client = gw.openai()
    first = await client.responses.create(model="p", input=QUESTION)
    edited = [*USER, {"role": "assistant", "content": "It is 84."}, {"role": "user", "content": "Sure?"}]
    await client.responses.create(model="p", input=edited)
    (segment,) = gw.session.state.segments
    assert gw.session.state.num_forks == 1 and segment.num_sampled_tokens == first.usage.output_tokens
    assert gw.data.prompt_ids == gw.ctx.encoder.encode_prompt(edited, None)  # its own rendering, not a splice


def _sse(raw: bytes) -> list[dict]:
    events = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if line)
        if lines:
            data = json.loads(lines["data"])
            assert lines["event"] == data["type"]
            events.append(data)
    return events


async def test_streamed_text_is_the_records_tokens_decoded_token_for_token(make_gateway, tiny_tokenizer):
    text = "Résultat : 12 × 7 = 84 ✓ — the answer is \\boxed{84}."
    gw = await make_gateway([text], policy_version=4)
    client = gw.openai()
    kinds, deltas, delta_logprobs = [], [], []
    async with client.responses.stream(model="p", input=QUESTION, include=LOGPROBS) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
                delta_logprobs += event.logprobs
        final = await stream.get_final_response()
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    gw.session.finish()
    (run,) = sampled_runs(gw.data)  # the call's sampled tokens on the record
    assert "".join(deltas) == tiny_tokenizer.decode(run, skip_special_tokens=True) == text == final.output_text
    assert [lp.token for lp in delta_logprobs] == [tiny_tokenizer.decode([t]) for t in run]
    assert [lp.logprob for lp in delta_logprobs] == gw.data.behavior_logprobs
    assert gw.data.policy_versions == [4] * len(run)
    # The wire: every event numbered in order, and a retry without `stream` is the same journaled answer.
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {gw.api_key}"}) as http:
        body = {"model": "p", "input": QUESTION, "include": LOGPROBS}
        raw = await http.post(f"{gw.base_url}/responses", json=body | {"stream": True})
        plain = (await http.post(f"{gw.base_url}/responses", json=body)).json()
    events = _sse(raw.content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"] == plain and plain["id"] == final.id
    assert len(gw.engine.requests_seen) == 1


async def test_a_streamed_tool_call_leaves_out_the_markup_as_the_plain_response_does(make_gateway, tiny_tokenizer):
    turn = "I will use the calculator.\n" + CALL
    gw = await make_gateway([turn, ANSWER])
    client = gw.openai()
    text, args, kinds = "", "", []
    stream = await client.responses.create(model="p", input=QUESTION, tools=[TOOL], stream=True)
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.function_call_arguments.delta":
            args += event.delta
        elif event.type == "response.completed":
            final = event.response
    assert kinds.count("response.function_call_arguments.done") == 1 and kinds[-1] == "response.completed"
    plain = await client.responses.create(model="p", input=QUESTION, tools=[TOOL])  # the journaled answer
    assert plain.id == final.id and text == plain.output_text == "I will use the calculator."
    (run,) = [b.token_ids for b in gw.session.state.branches]
    assert text == gw.ctx.parser.parse(tiny_tokenizer.decode(run, skip_special_tokens=True)).content
    assert "<tool_call>" in tiny_tokenizer.decode(run) and "<tool_call>" not in text
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert json.loads(args) == json.loads(call.arguments) == {"expression": "12 * 7"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "84"}
    async with client.responses.stream(
        model="p", input=[result], previous_response_id=final.id, tools=[TOOL]
    ) as stream:
        second = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
    assert second == ANSWER and gw.session.state.num_forks == 0 and gw.session.state.num_calls == 2


async def test_unknown_or_unstored_previous_responses_and_built_in_tools_are_refused(make_gateway):
    gw = await make_gateway(["The answer is 84."])
    client = gw.openai()
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="p", input="Sure?", previous_response_id="resp_nope")
    assert err.value.status_code == 400
    assert err.value.body["code"] == "previous_response_not_found" and err.value.body["param"] == "previous_response_id"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert gw.engine.requests_seen == [] and gw.session.state.num_calls == 0
    unstored = await client.responses.create(model="p", input=QUESTION, store=False)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError, match="not found"):
        await client.responses.create(model="p", input="Sure?", previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="web_search") as err:
        await client.responses.create(model="p", input=QUESTION, tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0]"
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
    with pytest.raises(openai.BadRequestError, match="input_image"):
        await client.responses.create(model="p", input=[image])
    assert len(gw.engine.requests_seen) == 1 and gw.session.state.num_calls == 1


async def test_a_restarted_program_is_replayed_and_chains_onto_the_earlier_attempt(make_gateway):
    gw = await make_gateway([CALL, ANSWER, "Yes, I am sure."])

    async def post(body: dict) -> httpx.Response:
        async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {gw.api_key}"}) as http:
            reply = await http.post(f"{gw.base_url}/responses", json=body)
        assert reply.status_code == 200, reply.text
        return reply

    def program(answers: list[dict]) -> list[dict]:
        """The program's calls, given the answers it got before: a tool call, its result, a follow-up."""
        calls = [{"model": "p", "input": QUESTION, "tools": [TOOL]}]
        if answers:
            (call,) = answers[0]["output"]
            result = {"type": "function_call_output", "call_id": call["call_id"], "output": "84"}
            calls.append({"model": "p", "input": [result], "previous_response_id": answers[0]["id"], "tools": [TOOL]})
        if len(answers) > 1:
            calls.append({"model": "p", "input": "Sure?", "previous_response_id": answers[1]["id"], "tools": [TOOL]})
        return calls

    sent = []
    for k in range(2):
        sent.append((await post(program([json.loads(b) for b in sent])[k])).content)
    before = _record(gw.data)
    # The worker dies; attempt 1 resumes from the admission row and the journal's two records.
    session = await gw.open_session(new_data(attempt=1))
    assert _record(session.data) == before and session.state.num_calls == 2
    stored = await gw.openai().responses.retrieve(json.loads(sent[1])["id"])  # folded back, before any replay
    assert stored.output_text == ANSWER
    replies = []
    for k in range(3):
        replies.append((await post(program([json.loads(b) for b in replies])[k])).content)
    assert replies[:2] == sent and session.state.num_replayed == 2  # byte for byte, nothing sampled again
    last = json.loads(replies[2])
    # The third call names attempt 0's response: found in the folded journal, and it extends the record.
    assert last["previous_response_id"] == json.loads(sent[1])["id"] and last["output"][0]["content"][0]["text"] == (
        "Yes, I am sure."
    )
    assert len(gw.engine.requests_seen) == 3 and session.state.num_forks == 0
    assert [(r.attempt, r.seq) for r in gw.journal.records] == [(0, 0), (0, 1), (1, 2)]
    links = [CallRecord.model_validate_json(r.payload).entry.link for r in gw.journal.records]
    assert [link.previous if link else "?" for link in links] == [
        None,
        json.loads(sent[0])["id"],
        last["previous_response_id"],
    ]
    session.finish()
    assert [m["role"] for m in session.data.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]


async def test_a_weight_sync_mid_response_parks_and_the_call_completes(make_gateway, tiny_tokenizer):
    gw = await make_gateway([LONG], token_delay_s=0.01, policy_version=0)
    ctx, engine = gw.ctx, gw.engine
    call = asyncio.create_task(gw.openai().responses.create(model="p", input=QUESTION, stream=False))
    for _ in range(2000):
        if ctx.num_in_engine:
            break
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.1)
    ctx.cancel.set()
    while ctx.num_in_engine:
        await asyncio.sleep(0.002)
    await engine.pause()
    await engine.set_policy_version(1)  # the weights change while the call waits
    await asyncio.sleep(0.05)
    assert not call.done() and ctx.num_in_engine == 0  # parked: nothing sent meanwhile
    await engine.resume()
    ctx.cancel.clear()
    out = await call
    assert out.output_text == LONG and out.status == "completed"
    gw.session.finish()
    target = tiny_tokenizer.encode(LONG, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    versions = gw.data.policy_versions
    k = versions.index(1)
    assert gw.data.response_ids == target and 0 < k and versions == [0] * k + [1] * (len(target) - k)
    assert gw.session.state.num_interrupts == 1 and engine.requests_seen[1][1] == gw.data.prompt_ids + target[:k]


async def test_journal_records_do_not_grow_with_a_resent_conversation(tiny_tokenizer):
    """A program that sends its whole conversation again each call (no previous_response_id, `store`
    on, as the Agents SDK does) still makes only its new input durable per call."""
    answer = tiny_tokenizer.encode("Next I add the following item to the running total.", add_special_tokens=False)
    ctx = gateway_ctx(tiny_tokenizer, FakeEngine(script=lambda prompt: [*answer, tiny_tokenizer.eos_token_id]))
    ctx.cfg.response_length = 64 * 60
    sizes: list[int] = []

    async def append(record) -> None:
        sizes.append(len(record.payload.encode()))

    ctx.append_journal = append
    data = new_data()
    data.state = AgentState.INTERACTING
    session = Session(ctx, data, ctx.cfg.gateway)
    items: list[dict] = [{"role": "user", "content": "Add up the items of the list, one at a time."}]
    for i in range(60):
        body = {"model": "p", "input": items, "max_output_tokens": 32}
        key, body_sha = call_key(session.session_id, 0, "responses", body)
        out = await session.complete(responses.parse(body), key, body_sha, CallStats())
        items = [*items, *out["output"], {"role": "user", "content": f"Item {i} is {17 * i}."}]
    assert session.state.num_calls == 60 and session.state.num_forks == 0
    # Each stored response links to the one before: its record holds two new messages, not the history.
    assert statistics.median(sizes[-10:]) < 1.2 * statistics.median(sizes[:10])
    conversation = responses.history(session._stored, out["id"])
    assert len(conversation) == len(items) - 1 and conversation[-1]["role"] == "assistant"


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_the_agents_sdk_default_responses_model_records_one_sequence(make_gateway, streamed):
    from agents import Agent, OpenAIResponsesModel, Runner

    from streamrl.workloads.agents.openai_sdk_calculator import calculator

    gw = await make_gateway(["Let me check.\n" + CALL, ANSWER])  # text and a call: one message, one function_call
    model = OpenAIResponsesModel(model="policy", openai_client=gw.openai())
    agent = Agent(name="calculator", model=model, tools=[calculator])
    if streamed:
        result = Runner.run_streamed(agent, QUESTION, max_turns=4)
        kinds = [e.data.type async for e in result.stream_events() if e.type == "raw_response_event"]
        assert kinds.count("response.completed") == 2 and "response.function_call_arguments.done" in kinds
    else:
        result = await Runner.run(agent, QUESTION, max_turns=4)
    assert result.final_output == ANSWER
    state = gw.session.state
    assert (state.num_calls, state.num_forks, gw.server.num_errors) == (2, 0, 0)
    gw.session.finish()
    assert [m["role"] for m in gw.data.messages] == ["user", "assistant", "tool", "assistant"]
    assert gw.data.messages[1]["content"] == "Let me check." and gw.data.messages[2]["content"] == "84"
    runs = [m for i, m in enumerate(gw.data.response_mask) if i == 0 or m != gw.data.response_mask[i - 1]]
    assert runs == [1, 0, 1]
