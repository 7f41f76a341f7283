"""Fixtures of the gateway tests: a scripted FakeEngine behind a ServerManager, the tiny model's
tokenizer and chat template, and the real gateway server (uvicorn on 127.0.0.1, an ephemeral port) on
the test's event loop, with one live session.

`Gateway.openai()` / `.anthropic()` are the official async SDK clients pointed at the session, with
retries off unless asked for, so a test sees each status code as the server sent it. The context's
journal hooks write to `Gateway.journal` (`MemoryJournal`: what the buffer keeps of a running
trajectory), so every answered call is made "durable" there before it is sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest_asyncio

from streamrl.engines.fake import FakeEngine
from streamrl.rollout.agent_loop import AgentContext
from streamrl.rollout.agent_loop.observation import ObservationEncoder
from streamrl.rollout.config import AgentConfig
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.server import GatewayServer
from streamrl.rollout.gateway.session import Session
from streamrl.rollout.parsers import get_parser
from streamrl.rollout.rewards import get_reward_fn
from streamrl.rollout.server_manager import ServerManager
from streamrl.rollout.types import AgentData, AgentState, JournalRecord
from tests.rollout.test_agent_loop import turn_script

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
ANTHROPIC_CALC_TOOL = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "input_schema": CALC_TOOL["function"]["parameters"],
}


def gateway_ctx(tokenizer, engine, *, gateway: GatewayConfig | None = None, **cfg) -> AgentContext:
    cfg.setdefault("prompt_length", 1024)
    agent_cfg = AgentConfig(response_length=600, max_tokens_per_turn=200, gateway=gateway or GatewayConfig(), **cfg)
    return AgentContext(
        cfg=agent_cfg,
        server=ServerManager([engine]),
        tokenizer=tokenizer,
        encoder=ObservationEncoder(tokenizer),
        parser=get_parser("hermes"),
        reward_fn=get_reward_fn("math_answer"),
    )


def new_data(tid: str = "g0/0", attempt: int = 0) -> AgentData:
    return AgentData(
        trajectory_id=tid,
        group_id="g0",
        agent_name="gateway",
        messages=[{"role": "user", "content": "What is 12 times 7?"}],
        ground_truth="84",
        attempt=attempt,
    )


@dataclass
class MemoryJournal:
    """The journal hooks of a worker, over a list (the buffer's `append_journal` / `journal`)."""

    records: list[JournalRecord] = field(default_factory=list)

    async def append(self, record: JournalRecord) -> None:
        self.records.append(record)

    async def read(self, trajectory_id: str) -> list[JournalRecord]:
        return [r for r in self.records if r.trajectory_id == trajectory_id]

    def wire(self, ctx: AgentContext) -> None:
        ctx.append_journal, ctx.read_journal = self.append, self.read

    @property
    def num_bytes(self) -> int:
        return sum(len(r.payload.encode()) for r in self.records)


@dataclass
class Gateway:
    server: GatewayServer
    session: Session
    ctx: AgentContext
    engine: FakeEngine
    journal: MemoryJournal

    @property
    def data(self) -> AgentData:
        return self.session.data

    @property
    def api_key(self) -> str:
        """The live session's own bearer token (what the gateway loop gives its program)."""
        return self.session.token

    @property
    def base_url(self) -> str:
        return self.server.base_url(self.session)

    def openai(self, **kw: Any):
        import openai

        kw.setdefault("api_key", self.api_key)
        kw.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.base_url, **kw)

    def anthropic(self, **kw: Any):
        import anthropic

        kw.setdefault("api_key", self.api_key)
        kw.setdefault("max_retries", 0)
        return anthropic.AsyncAnthropic(base_url=self.base_url.removesuffix("/v1"), **kw)

    async def open_session(self, data: AgentData) -> Session:
        """A session for `data` (replacing the live one), as the gateway loop opens it: a resumed
        attempt's folds the journal's records of the earlier ones."""
        self.server.remove(self.session)
        self.session = Session(self.ctx, data, self.ctx.cfg.gateway)
        await self.session.recover()
        data.state = AgentState.INTERACTING
        self.server.add(self.session)
        return self.session


async def start_gateway(tokenizer, engine: FakeEngine, **gateway_kw: Any) -> Gateway:
    ctx = gateway_ctx(tokenizer, engine, gateway=GatewayConfig(**gateway_kw))
    journal = MemoryJournal()
    journal.wire(ctx)
    server = GatewayServer(ctx.cfg.gateway)
    await server.start()
    data = new_data()
    data.state = AgentState.INTERACTING
    session = Session(ctx, data, ctx.cfg.gateway)
    server.add(session)
    return Gateway(server=server, session=session, ctx=ctx, engine=engine, journal=journal)


@pytest_asyncio.fixture
async def make_gateway(tiny_tokenizer):
    """`await make_gateway(turns, **engine_kw, gateway=dict(...))`: a started gateway whose engine
    answers assistant turn k with `turns[k]` (see `turn_script`)."""
    started: list[Gateway] = []

    async def make(turns: list[str] | None = None, *, script=None, gateway: dict | None = None, **engine_kw) -> Gateway:
        if script is None:
            script, _ = turn_script(tiny_tokenizer, turns or ["Hello there."])
        gw = await start_gateway(tiny_tokenizer, FakeEngine(script=script, **engine_kw), **(gateway or {}))
        started.append(gw)
        return gw

    yield make
    for gw in started:
        await gw.server.stop()
