"""A gateway session's state grows with its calls, not with their square: each answered call makes only
its own record durable (what is written for 200 calls is about twice what is written for 100, and a
late call's record is no larger than an early one's); a fork does not reset the response budget (the
session's budget counts the records it forked away from); and a crash at any point mid-session is
recovered from the admission row plus the journal, replaying every earlier answer byte for byte and
rebuilding the token record exactly."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import httpx
import pytest

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.gateway import protocol
from streamrl.rollout.gateway.session import CallStats, Session, call_key
from streamrl.rollout.types import AgentData, AgentState
from tests.rollout.gateway.conftest import gateway_ctx, new_data

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "Add up the items of the list, one at a time."}]


class Durable:
    """Bytes made durable through either of the worker's hooks: a whole partial row (`snapshot`) or a
    journal record (`append_journal`)."""

    def __init__(self) -> None:
        self.per_call: list[int] = []

    async def snapshot(self, data: AgentData) -> None:
        self.per_call.append(len(data.to_json().encode()))

    async def append_journal(self, record: Any) -> None:
        self.per_call.append(len(record.payload.encode()))


async def _run_session(tokenizer, num_calls: int) -> Durable:
    answer = tokenizer.encode("Next I add the following item to the running total.", add_special_tokens=False)
    engine = FakeEngine(script=lambda prompt: [*answer, tokenizer.eos_token_id])
    ctx = gateway_ctx(tokenizer, engine)
    ctx.cfg.response_length = 64 * num_calls
    durable = Durable()
    ctx.snapshot, ctx.append_journal = durable.snapshot, durable.append_journal
    data = new_data()
    data.state = AgentState.INTERACTING
    session = Session(ctx, data, ctx.cfg.gateway)
    messages = list(USER)
    for i in range(num_calls):
        body = {"model": "p", "messages": messages, "max_tokens": 32}
        key, body_sha = call_key(session.session_id, 0, "chat/completions", body)
        out = await session.complete(protocol.parse_openai(body, max_choices=8), key, body_sha, CallStats())
        observation = {"role": "user", "content": f"Item {i} is {17 * i}."}
        messages = [*messages, out["choices"][0]["message"], observation]
    assert session.state.num_calls == num_calls and session.state.num_forks == 0
    return durable


async def test_bytes_made_durable_grow_linearly_with_the_calls(tiny_tokenizer):
    short, long = await _run_session(tiny_tokenizer, 100), await _run_session(tiny_tokenizer, 200)
    assert len(short.per_call) == 100 and len(long.per_call) == 200  # one durable write per answered call
    # Linear: 200 calls write 2x what 100 do (quadratic would be 4x); the bound leaves room for noise.
    assert sum(long.per_call) < 2.5 * sum(short.per_call)
    # And flat: a call late in the session writes no more than one early in it.
    assert statistics.median(long.per_call[-20:]) < 1.2 * statistics.median(long.per_call[:20])


async def test_a_fork_does_not_reset_the_response_budget(make_gateway, tiny_tokenizer):
    answer = tiny_tokenizer.encode(" ".join(["word"] * 29), add_special_tokens=False)[:29]
    gw = await make_gateway(script=lambda prompt: [*answer, tiny_tokenizer.eos_token_id])  # 30 tokens a call
    gw.ctx.cfg.response_length = 45
    client = gw.openai()
    first = await client.chat.completions.create(model="p", messages=USER)
    assert first.usage.completion_tokens == 30 and first.choices[0].finish_reason == "stop"
    # The agent rewrites its history: a fork. Its record starts over, its budget does not.
    edited = [*USER, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="p", messages=edited)
    assert gw.session.state.num_forks == 1
    assert second.usage.completion_tokens == 15 and second.choices[0].finish_reason == "length"
    # Nothing is left: a further fork is refused for the budget, and not sampled.
    again = [*USER, {"role": "assistant", "content": "Done twice."}, {"role": "user", "content": "More."}]
    sampled = len(gw.engine.requests_seen)
    with pytest.raises(Exception, match="budget"):
        await client.chat.completions.create(model="p", messages=again)
    assert len(gw.engine.requests_seen) == sampled and gw.session.state.length_exceeded
    gw.session.finish()
    spent = sum(s.num_response_tokens for s in gw.session.state.segments) + len(gw.data.response_ids)
    assert spent == 45


def _record_of(data: AgentData) -> tuple:
    return (
        data.prompt_ids,
        data.response_ids,
        data.response_mask,
        data.behavior_logprobs,
        data.policy_versions,
        [protocol.canonical_message(m) for m in data.messages],
        data.num_user_turns,
        data.num_assistant_turns,
        data.num_tool_calls,
    )


async def test_a_crash_mid_session_replays_every_earlier_answer_byte_for_byte(make_gateway, tiny_tokenizer):
    counter = itertools.count()

    def script(prompt: list[int]) -> list[int]:  # every sample a new text: a re-sample would show
        return [
            *tiny_tokenizer.encode(f"Sample {next(counter)}.", add_special_tokens=False),
            tiny_tokenizer.eos_token_id,
        ]

    gw = await make_gateway(script=script)

    async def post(body: dict) -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as http:
            headers = {"authorization": f"Bearer {gw.api_key}"}
            return await http.post(f"{gw.base_url}/chat/completions", json=body, headers=headers)

    def program_calls(answers: list[dict]) -> list[dict]:
        """The program's call k, given the answers it got before: extends, one fork, two choices."""
        calls, messages = [], list(USER)
        for k in range(6):
            if k == 3:  # the agent rewrites its history
                messages = [*USER, {"role": "assistant", "content": "Let me start over."}]
            body: dict[str, Any] = {"model": "p", "messages": [*messages, {"role": "user", "content": f"Step {k}."}]}
            if k == 4:
                body["n"] = 2
            calls.append(body)
            if k < len(answers):
                messages = [*body["messages"], answers[k]["choices"][-1]["message"]]
        return calls

    sent: list[bytes] = []
    for k in range(5):
        body = program_calls([httpx.Response(200, content=b).json() for b in sent])[k]
        reply = await post(body)
        assert reply.status_code == 200
        sent.append(reply.content)
    assert gw.session.state.num_forks == 1 and len(gw.journal.records) == 5
    before = _record_of(gw.data)
    branches = [b.model_dump() for b in gw.session.state.branches]

    # The worker dies. Attempt 1 resumes from the admission row and the journal.
    session = await gw.open_session(new_data(attempt=1))
    assert _record_of(session.data) == before and [b.model_dump() for b in session.state.branches] == branches
    assert session.state.num_forks == 1 and session.state.num_calls == 5
    replies: list[bytes] = []
    for k in range(6):
        reply = await post(program_calls([httpx.Response(200, content=b).json() for b in replies])[k])
        assert reply.status_code == 200
        replies.append(reply.content)
    assert replies[:5] == sent  # every earlier answer, byte for byte
    assert len(gw.engine.requests_seen) == 4 + 2 + 1  # four calls and one of n=2 before the crash; the sixth since
    assert session.state.num_replayed == 5 and session.state.num_forks == 1
