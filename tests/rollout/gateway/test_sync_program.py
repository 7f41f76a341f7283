"""Sync `program`s run in the gateway's own bounded daemon threads, never in asyncio's default
executor: a hung one keeps its thread past its timeout (threads cannot be cancelled), and enough of
them would otherwise stall image decoding and every other `to_thread` caller of the worker."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.loop import ProgramError, run_program

pytestmark = pytest.mark.timeout(60)

HERE = "tests.rollout.gateway.test_sync_program"
RELEASE = threading.Event()


def hung_program(base_url: str, api_key: str, sample: dict) -> float:
    RELEASE.wait(30)  # a program stuck on I/O that never returns (until the test lets it go)
    return 0.0


def quick_program(base_url: str, api_key: str, sample: dict) -> float:
    return 0.75


async def test_hung_sync_programs_never_block_the_default_executor():
    RELEASE.clear()
    num_default_threads = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's own default size
    cfg = GatewayConfig(program=f"{HERE}:hung_program", timeout_s=0.2)
    try:
        outcomes = await asyncio.gather(
            *(run_program(cfg, "http://unused/v1", "token", {}) for _ in range(num_default_threads)),
            return_exceptions=True,
        )
        assert all(isinstance(o, ProgramError) for o in outcomes)  # each timed out; its thread runs on
        loop = asyncio.get_running_loop()
        assert await asyncio.wait_for(loop.run_in_executor(None, lambda: 7), 2) == 7
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 8), 2) == 8
        quick = GatewayConfig(program=f"{HERE}:quick_program", timeout_s=5)
        assert await run_program(quick, "http://unused/v1", "token", {}) == 0.75
    finally:
        RELEASE.set()
