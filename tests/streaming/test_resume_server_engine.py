"""A resumed run's server engine serves the checkpoint's weights before it answers anything under the
checkpoint's policy version. An in-process engine builds its model from the checkpoint's `hf/`
folder; a server serves what it was started with (the base model), so the engine actor loads the
checkpoint into it first. The parts are real (the engine actor's body, `SGLangServerEngine`, HTTP)
but for the server: tests/engines/fake_sglang.py, whose tokens depend on how many weight loads it had."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from streamrl.engines.base import SamplingParams
from streamrl.engines.config import EngineConfig
from streamrl.streaming.actors.engine import EngineActor
from tests.engines.fake_sglang import FakeSGLang, token_at

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 17, 42, 99]


@pytest.fixture
def sglang():
    """The fake server on its own thread and loop: the engine actor builds its engine synchronously
    (a health check that blocks its loop), as it does in its Ray actor with the server elsewhere."""
    fake = FakeSGLang()
    up = threading.Event()
    handle: list = []

    async def serve() -> None:
        server, task = await fake.serve()
        handle.append((asyncio.get_running_loop(), server))
        up.set()
        await task

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert up.wait(10)
    yield fake
    loop, server = handle[0]
    loop.call_soon_threadsafe(setattr, server, "should_exit", True)
    thread.join(10)


def _checkpoint(run_dir: Path) -> Path:
    hf = run_dir / "checkpoints" / "step_000006" / "hf"
    hf.mkdir(parents=True)
    (hf / "model.safetensors").write_bytes(b"")
    return hf


async def test_a_resumed_server_engine_loads_the_checkpoint_before_its_first_request(sglang, tmp_path):
    hf = _checkpoint(tmp_path)
    cfg = EngineConfig(
        backend="sglang_server", server_urls=[f"http://127.0.0.1:{sglang.port}"], max_model_len=256, model=str(hf)
    )
    actor = EngineActor(cfg, "engine-0", 3, weights=str(hf))
    try:  # the first calls race the engine's start, as a resumed run's resubmitted trajectories do
        out, served = await asyncio.gather(actor.generate("r1", PROMPT, SamplingParams(max_tokens=5)), actor.ping())
    finally:
        await actor.shutdown()
    assert served == 3 and out.policy_versions == [3] * 5
    assert out.token_ids == [token_at(PROMPT, i, 1) for i in range(5)]  # sampled after one weight load
    paths = sglang.paths()
    assert paths.count("/update_weights_from_disk") == 1
    assert paths.index("/update_weights_from_disk") < paths.index("/generate")
    (load,) = [body for path, body in sglang.calls if path == "/update_weights_from_disk"]
    assert load["model_path"] == str(hf.resolve()) and load["weight_version"] == "3"


async def test_a_fresh_server_engine_serves_what_its_server_started_with(sglang):
    cfg = EngineConfig(backend="sglang_server", server_urls=[f"http://127.0.0.1:{sglang.port}"], max_model_len=256)
    actor = EngineActor(cfg, "engine-0", 0)
    try:
        out = await actor.generate("r1", PROMPT, SamplingParams(max_tokens=3))
    finally:
        await actor.shutdown()
    assert out.token_ids == [token_at(PROMPT, i, 0) for i in range(3)] and out.policy_versions == [0] * 3
    assert "/update_weights_from_disk" not in sglang.paths()
