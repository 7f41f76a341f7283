"""The gateway server's counters (`rollout/gateway/*`, reported in the worker's metrics): each kind of
call is counted once, as what it was: sampled, a retry answered from the journal, a fork, an error, a
call a weight sync parked; the overhead counts only the handler's time outside the engine."""

from __future__ import annotations

import asyncio

import openai
import pytest

from streamrl.core import catalogue

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "What is 12 times 7?"}]


def counts(gw) -> dict[str, float]:
    return {k.removeprefix("rollout/gateway/"): v for k, v in gw.server.metrics().items()}


async def test_each_kind_of_call_is_counted_once(make_gateway):
    gw = await make_gateway(["The answer is 84.", "The answer is 85."])
    client = gw.openai()
    await client.chat.completions.create(model="p", messages=USER)
    await client.chat.completions.create(model="p", messages=USER)  # a retry: the journal answers
    edited = [*USER, {"role": "assistant", "content": "It is 84."}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="p", messages=edited)  # a history rewrite: a fork
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="p", messages=USER, n=0)
    c = counts(gw)
    assert (c["num_requests"], c["num_sampled"], c["num_retries_answered"], c["num_forks"], c["num_errors"]) == (
        4,
        2,
        1,
        1,
        1,
    )
    assert (c["num_replayed"], c["num_calls_across_sync"], c["num_sessions"]) == (0, 0, 1)
    assert 0 < c["overhead_sum_s"] < 5
    assert all(catalogue.lookup(k) is not None for k in gw.server.metrics())


async def test_a_call_parked_by_a_weight_sync_is_counted_and_its_wait_is_not_overhead(make_gateway):
    gw = await make_gateway(["The answer is 84."])
    gw.ctx.cancel.set()  # a sync under way when the call arrives: it parks before sending anything
    call = asyncio.create_task(gw.openai().chat.completions.create(model="p", messages=USER))
    await asyncio.sleep(2.0)
    assert not call.done() and gw.engine.requests_seen == []
    gw.ctx.cancel.clear()
    await call
    c = counts(gw)
    assert (c["num_sampled"], c["num_calls_across_sync"], c["num_errors"]) == (1, 1, 0)
    assert c["overhead_sum_s"] < 1.0  # the 2 s parked are the engine's side of the call, not overhead
