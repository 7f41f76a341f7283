"""Exactly-once answers: a retried identical call gets the journaled answer, never a new sample; the
call's journal record is durable (the context's `append_journal` hook returned) before the response
leaves; an append that fails fails the session instead of sending an answer that is not durable; a
resumed trajectory's restarted program gets its earlier calls answered from the journal."""

from __future__ import annotations

import asyncio

import openai
import pytest

from streamrl.rollout.gateway.journal import CallRecord
from streamrl.rollout.types import JournalRecord
from tests.rollout.gateway.conftest import new_data
from tests.rollout.test_agent_loop import ANSWER

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "What is 12 times 7?"}]


async def test_a_retried_identical_call_gets_the_journaled_answer(make_gateway):
    gw = await make_gateway(["The answer is 84.", "Something else."])
    client = gw.openai()
    first = await client.chat.completions.create(model="p", messages=USER)
    again = await client.chat.completions.create(model="p", messages=USER)
    assert again.id == first.id and again.choices[0].message.content == first.choices[0].message.content
    stream = await client.chat.completions.create(model="p", messages=USER, stream=True)  # a streamed retry
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == first.choices[0].message.content
    assert len(gw.engine.requests_seen) == 1 and gw.session.state.num_retries_answered == 2
    other = await client.chat.completions.create(model="p", messages=USER, max_tokens=50)  # another call
    assert other.id != first.id and len(gw.engine.requests_seen) == 2


async def test_an_sdk_retry_after_a_client_timeout_is_answered_once(make_gateway):
    gw = await make_gateway(["The answer is \\boxed{84}, computed slowly."], token_delay_s=0.02)
    client = gw.openai(max_retries=3, timeout=0.15)  # the answer takes ~0.4 s: the SDK times out and retries
    out = await client.chat.completions.create(model="p", messages=USER)
    assert out.choices[0].message.content == "The answer is \\boxed{84}, computed slowly."
    assert len(gw.engine.requests_seen) == 1  # sampled once; the retry waited for it and got the journal
    assert gw.session.state.num_retries_answered >= 1 and len(gw.session.state.journal) == 1


async def test_the_journal_record_is_durable_before_the_response(make_gateway):
    gw = await make_gateway([ANSWER])
    release = asyncio.Event()
    records: list[JournalRecord] = []

    async def append(record: JournalRecord) -> None:
        records.append(record)
        await release.wait()  # the buffer's write and fsync take their time

    gw.ctx.append_journal = append
    call = asyncio.create_task(gw.openai().chat.completions.create(model="p", messages=USER))
    for _ in range(2000):
        if records:
            break
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.05)
    assert not call.done()  # no answer before the append returned
    assert gw.session.state.num_calls == 0 and not gw.data.prompt_ids  # nor any change to the session
    release.set()
    out = await call
    (record,) = records
    assert (record.trajectory_id, record.attempt, record.seq) == (gw.data.trajectory_id, 0, 0)
    entry = CallRecord.model_validate_json(record.payload).entry
    assert entry.response["id"] == out.id
    assert entry.response["choices"][0]["message"]["content"] == out.choices[0].message.content


async def test_a_failed_append_fails_the_session_and_sends_no_answer(make_gateway):
    gw = await make_gateway([ANSWER])

    async def broken(record: JournalRecord) -> None:
        raise OSError("buffer log: no space left on device")

    gw.ctx.append_journal = broken
    client = gw.openai()
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="p", messages=USER)
    with pytest.raises(openai.InternalServerError, match="session failed"):
        await client.chat.completions.create(model="p", messages=USER)  # not even the journaled one
    assert isinstance(gw.session.failed, OSError)


async def test_a_restarted_program_replays_from_the_journal_of_an_earlier_attempt(make_gateway):
    gw = await make_gateway(["The answer is 84.", "Yes, I am sure."])
    client = gw.openai()
    first = await client.chat.completions.create(model="p", messages=USER)
    # The worker dies; the trajectory resumes in attempt 1 from its admission row and the journal.
    session = await gw.open_session(new_data(attempt=1))
    assert session.state.attempt == 1 and session.state.num_records == 1
    client = gw.openai()  # the new attempt's URL
    assert "/1/v1" in str(client.base_url)
    replayed = await client.chat.completions.create(model="p", messages=USER)
    assert replayed.choices[0].message.content == first.choices[0].message.content
    assert len(gw.engine.requests_seen) == 1 and session.state.num_replayed == 1
    more = [*USER, replayed.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    out = await client.chat.completions.create(model="p", messages=more)
    assert out.choices[0].message.content == "Yes, I am sure." and session.state.num_forks == 0
    assert [(r.attempt, r.seq) for r in gw.journal.records] == [(0, 0), (1, 1)]
