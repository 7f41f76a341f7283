"""Fixtures of the harness tests: the real gateway server (`tests/rollout/gateway/conftest.py`) whose
engine answers assistant turn k with `turns[k]`."""

from __future__ import annotations

import pytest_asyncio

from streamrl.engines.fake import FakeEngine
from tests.rollout.gateway.conftest import start_gateway
from tests.rollout.test_agent_loop import turn_script


@pytest_asyncio.fixture
async def make_gateway(tiny_tokenizer):
    """`await make_gateway(turns)` -> (a started gateway, the token ids of each scripted turn)."""
    started = []

    async def make(turns: list[str]):
        script, turn_ids = turn_script(tiny_tokenizer, turns)
        gw = await start_gateway(tiny_tokenizer, FakeEngine(script=script))
        gw.ctx.cfg.response_length = 4000  # observations spend the session's budget too
        gw.ctx.cfg.max_tokens_per_turn = 1000  # a long command is many tokens of the tiny model's vocabulary
        started.append(gw)
        return gw, turn_ids

    yield make
    for gw in started:
        await gw.server.stop()
