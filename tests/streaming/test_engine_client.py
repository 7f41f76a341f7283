"""`RayEngineClient` holds no label of its own: its `policy_version` is what the engine actor last
acknowledged (a relabel, a ping), and nothing outside the client can set it."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engines.config import EngineConfig
from streamrl.engines.fake import FakeEngine
from tests.rollout.test_images import _StubActor


async def test_the_client_s_label_is_the_engine_s_last_acknowledged_one_and_read_only():
    from streamrl.streaming.actors.engine import EngineActor, RayEngineClient

    cfg = EngineConfig(device="cpu", call_timeout_s=10.0, startup_timeout_s=10.0)
    actor = EngineActor(cfg, "ray-0")
    fake = FakeEngine("ray-0", script=[[3]])
    fake.device = "cpu"
    actor._engine = fake  # the actor's engine, without building vLLM
    actor._starting = asyncio.get_running_loop().create_future()
    actor._starting.set_result(None)
    client = RayEngineClient(_StubActor(actor), "ray-0", cfg=cfg, policy_version=0)

    await client.set_policy_version(4)
    assert (client.policy_version, fake.policy_version) == (4, 4)
    fake.policy_version = 6  # the engine moved on without this client (another client committed)
    assert client.policy_version == 4  # what it last heard, until it asks
    assert await client.ping() == 6 and client.policy_version == 6
    with pytest.raises(AttributeError):
        client.policy_version = 7  # type: ignore[misc]
