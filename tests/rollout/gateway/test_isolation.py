"""Samples cannot reach each other's sessions: each session has its own bearer token, and a program
holding one cannot read a sibling's journaled answers or append turns to its record, even though it
can compute the sibling's session id from its trajectory id (the id is a hash of it)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from streamrl.rollout.gateway.loop import GatewayAgentLoop, close_gateway
from streamrl.rollout.gateway.session import session_id_for
from tests.rollout.gateway.conftest import new_data
from tests.rollout.gateway.test_loop import loop_ctx
from tests.rollout.test_agent_loop import ANSWER

pytestmark = pytest.mark.timeout(60)

HERE = "tests.rollout.gateway.test_isolation"
VICTIM, ATTACKER = "g0/0", "g0/1"
STATE: dict = {}


async def sibling_program(base_url: str, api_key: str, sample: dict) -> float:
    """The victim makes one call and waits; the attacker, given only its own URL and token, aims them
    at the victim's session: list models, repeat the victim's call (its journaled answer would come
    back) and continue the victim's conversation (a turn appended to its record)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    if sample["trajectory_id"] == VICTIM:
        out = await client.chat.completions.create(model="any", messages=sample["messages"])
        STATE["victim_answer"] = out.choices[0].message.content
        STATE["victim_called"].set()
        await STATE["attacked"].wait()
        return 1.0
    try:
        await STATE["victim_called"].wait()
        victim_url = base_url.replace(session_id_for(ATTACKER), session_id_for(VICTIM))
        headers = {"authorization": f"Bearer {api_key}"}
        more = [
            *sample["messages"],
            {"role": "assistant", "content": STATE["victim_answer"]},
            {"role": "user", "content": "Now say 85."},
        ]
        async with httpx.AsyncClient(headers=headers) as http:
            statuses = [(await http.get(f"{victim_url}/models")).status_code]
            for messages in (sample["messages"], more):
                r = await http.post(f"{victim_url}/chat/completions", json={"model": "p", "messages": messages})
                statuses.append(r.status_code)
            nowhere = base_url.replace(session_id_for(ATTACKER), session_id_for("g9/9"))
            r = await http.post(f"{nowhere}/chat/completions", json={"model": "p", "messages": more})
            statuses.append(r.status_code)
        STATE["statuses"] = statuses
    finally:
        STATE["attacked"].set()
    await client.chat.completions.create(model="any", messages=sample["messages"])  # its own session works
    return 0.0


async def test_a_program_cannot_read_or_append_to_a_sibling_session(tiny_tokenizer):
    STATE.clear()
    STATE.update(victim_called=asyncio.Event(), attacked=asyncio.Event())
    ctx, turn_ids = loop_ctx(tiny_tokenizer, [ANSWER, "85"], program=f"{HERE}:sibling_program")
    victim, attacker = new_data(VICTIM), new_data(ATTACKER)
    try:
        await asyncio.wait_for(
            asyncio.gather(GatewayAgentLoop(ctx).run(victim), GatewayAgentLoop(ctx).run(attacker)), 30
        )
    finally:
        await close_gateway(ctx)
    # 404 on the sibling's URL, exactly as on a session that does not exist: nothing read, nothing placed
    assert STATE["statuses"] == [404, 404, 404, 404]
    assert victim.gateway["num_calls"] == 1 and len(victim.gateway["journal"]) == 1
    assert victim.gateway["num_retries_answered"] == 0 and victim.num_user_turns == 0
    assert victim.response_ids == turn_ids[0] and victim.reward == 1.0
    assert attacker.gateway["num_calls"] == 1 and attacker.reward == 0.0


async def test_each_session_has_its_own_token_and_only_that_one_opens_it(make_gateway):
    gw = await make_gateway([ANSWER])
    first = gw.session
    second = await gw.open_session(new_data("g0/1"))
    gw.server.add(first)  # both live
    assert first.token != second.token and len(second.token) >= 32
    root = f"http://127.0.0.1:{gw.server.port}/s"
    body = {"model": "p", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient() as http:

        async def post(session_id: str, token: str) -> httpx.Response:
            auth = {"authorization": f"Bearer {token}"}
            return await http.post(f"{root}/{session_id}/0/v1/chat/completions", json=body, headers=auth)

        assert (await post(second.session_id, first.token)).status_code == 404
        assert (await post(first.session_id, second.token)).status_code == 404
        assert (await post(first.session_id, "x" * 43)).status_code == 401  # no live session's token
        r = await http.post(
            f"{root}/{first.session_id}/0/v1/messages",
            json=body | {"max_tokens": 5},
            headers={"x-api-key": first.token},
        )
        assert r.status_code == 200
    assert first.state.num_calls == 1 and second.state.num_calls == 0
